"""The E→P→D pipeline on one machine: tiny language model prefill and decode workers.

- :class:`LanguageModel`: a Qwen2-VL model used around spliced image embeddings (prefill,
  KV packing, greedy decode, and the colocated reference run).
- :class:`PrefillWorker`: embeddings from the encoders, prefill, KV into decode's memory.
- :class:`DecodeWorker`: admits requests to KV pages, commits their KV, decodes; aborted
  requests' pages are held until prefill acks the drain.
- :func:`run_demo` / :class:`DemoOptions`: ``encdisagg demo``, with a parity check.
- :func:`serve_asgi`: an ASGI app (the encoder server) served inside a task group.
"""

from .._exports import claim_exports
from ._decode import DecodeHandle as DecodeHandle, DecodeWorker as DecodeWorker
from ._decode_types import (
    DecodePhase as DecodePhase,
    DecodeResult as DecodeResult,
    DecodeStats as DecodeStats,
    DecodeStatus as DecodeStatus,
)
from ._demo import (
    DemoOptions as DemoOptions,
    DemoReport as DemoReport,
    RequestOutcome as RequestOutcome,
    run_demo as run_demo,
    serve_asgi as serve_asgi,
)
from ._images import DemoImage as DemoImage, demo_images as demo_images
from ._lm import (
    ByteTokenizer as ByteTokenizer,
    LanguageModel as LanguageModel,
    PrefillResult as PrefillResult,
)
from ._pd_messages import (
    AbortRequest as AbortRequest,
    BootstrapInfo as BootstrapInfo,
    DrainedAck as DrainedAck,
    KVDestination as KVDestination,
    TransferDone as TransferDone,
)
from ._prefill import PrefillWorker as PrefillWorker
from ._prefill_types import (
    PipelineRequest as PipelineRequest,
    PrefillReport as PrefillReport,
    PrefillStats as PrefillStats,
    PrefillStatus as PrefillStatus,
)

__all__ = (
    "LanguageModel",
    "ByteTokenizer",
    "PrefillResult",
    "PipelineRequest",
    "PrefillWorker",
    "PrefillReport",
    "PrefillStats",
    "PrefillStatus",
    "DecodeWorker",
    "DecodeHandle",
    "DecodePhase",
    "DecodeResult",
    "DecodeStatus",
    "DecodeStats",
    "BootstrapInfo",
    "KVDestination",
    "TransferDone",
    "AbortRequest",
    "DrainedAck",
    "DemoOptions",
    "DemoReport",
    "RequestOutcome",
    "run_demo",
    "DemoImage",
    "demo_images",
    "serve_asgi",
)

claim_exports(globals())
