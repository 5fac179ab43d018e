"""encdisagg: encoder disaggregation for multimodal LLM serving.

Vision and audio encoders run as their own service and ship embeddings to the LLM's prefill
instances. Every encode, send and transfer runs inside a task group that owns the memory it
touches, so memory is never released while a transfer still reads it.

The names that need torch (``Encoder`` and its request types) load on first use, so that
``import encdisagg`` and the command line's ``--help`` stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._config import EncoderConfig as EncoderConfig
from ._errors import (
    BadRequestError as BadRequestError,
    ConfigError as ConfigError,
    EncdisaggError as EncdisaggError,
    InternalError as InternalError,
    NotFoundError as NotFoundError,
    RequestNotActiveError as RequestNotActiveError,
    RequestTimeoutError as RequestTimeoutError,
    ServiceUnavailableError as ServiceUnavailableError,
    TransferError as TransferError,
    TransferTimeoutError as TransferTimeoutError,
)
from ._exports import claim_exports, lazy_exports
from ._modality import Modality as Modality
from ._version import __version__ as __version__

if TYPE_CHECKING:
    from .encoder import (
        Encoder as Encoder,
        EncodeRequest as EncodeRequest,
        EncodeResult as EncodeResult,
        EncoderStats as EncoderStats,
        MooncakeDestination as MooncakeDestination,
        ZmqDestination as ZmqDestination,
    )
    from .models import Preprocessed as Preprocessed, VisionModel as VisionModel
    from .transfer import TransferEngine as TransferEngine

_LAZY = {
    "Encoder": "encdisagg.encoder",
    "EncodeRequest": "encdisagg.encoder",
    "EncodeResult": "encdisagg.encoder",
    "EncoderStats": "encdisagg.encoder",
    "MooncakeDestination": "encdisagg.encoder",
    "ZmqDestination": "encdisagg.encoder",
    "TransferEngine": "encdisagg.transfer",
    "VisionModel": "encdisagg.models",
    "Preprocessed": "encdisagg.models",
}

__all__ = (
    "__version__",
    "EncoderConfig",
    "Modality",
    "Encoder",
    "EncodeRequest",
    "EncodeResult",
    "EncoderStats",
    "MooncakeDestination",
    "ZmqDestination",
    "TransferEngine",
    "VisionModel",
    "Preprocessed",
    "EncdisaggError",
    "BadRequestError",
    "ConfigError",
    "NotFoundError",
    "RequestNotActiveError",
    "RequestTimeoutError",
    "TransferError",
    "TransferTimeoutError",
    "ServiceUnavailableError",
    "InternalError",
)

claim_exports(globals())

__getattr__, __dir__ = lazy_exports(globals(), _LAZY, claim=False)
