"""The decode side: where KV written by prefill ranks lands, and when it may be reused.

The synchronous core (no awaits, driven by a scheduler loop or by property tests):

- :class:`KVPoll`: the states of a request's KV transfer.
- :class:`MetadataSlotAllocator`, :class:`PageAllocator`: slot and page indices, FIFO reuse,
  double frees caught.
- :class:`AbortAckTracker`: drained-acks of aborted requests, per room and generation.
- :class:`DecodePreallocQueue`: admission to pages and a slot, in order.
- :class:`DecodeTransferQueue`: one-pass compaction of transferred requests, and deferred
  release of aborted ones until their prefill ranks drained (:class:`HeldRelease`); its
  ``on_timeout`` policy says what becomes of one whose acks did not come in time: reused, or
  retired (:class:`DeferredResolution` reports which).
- :class:`DecodeBatchScheduler`: continuous batching over landed KV (prebuilt batches,
  metadata slots held until a draft state is consumed, retraction and resume).

Memory: :class:`KVPagePool` (pages in one registered buffer), :class:`MetadataSlotTable`
(rows tagged with the writer's room), :class:`PagedKVSink` (commit and release over both),
:class:`DraftLayout` (a draft state in a row's extra words), :class:`PagedKVBackup`
(retraction's copies).

The async shell: :func:`run_decode_step` runs one batched step of a
:class:`DecodeBatchScheduler` (:func:`run_decode_step_inline` on the loop's own thread).
"""

from .._exports import claim_exports
from ._acks import AbortAckTracker as AbortAckTracker
from ._backup import PagedKVBackup as PagedKVBackup
from ._batch_loop import (
    run_decode_step as run_decode_step,
    run_decode_step_inline as run_decode_step_inline,
)
from ._batching import (
    DecodeBatch as DecodeBatch,
    DecodeBatchScheduler as DecodeBatchScheduler,
    FinishReason as FinishReason,
    KVBackup as KVBackup,
    RunningRequest as RunningRequest,
)
from ._deferred import DeferredResolution as DeferredResolution, HeldRelease as HeldRelease
from ._draft import DraftLayout as DraftLayout, DraftState as DraftState
from ._pages import PageAllocator as PageAllocator, PageSource as PageSource
from ._poll import KVPoll as KVPoll
from ._pool import (
    KVPagePool as KVPagePool,
    MetadataSlotTable as MetadataSlotTable,
    PagedKVSink as PagedKVSink,
    kv_checksum as kv_checksum,
)
from ._prealloc import (
    DecodePreallocQueue as DecodePreallocQueue,
    PreallocPass as PreallocPass,
    PreallocRequest as PreallocRequest,
    ResumePass as ResumePass,
    RetractedRequest as RetractedRequest,
)
from ._request import DecodeRequest as DecodeRequest
from ._slots import MetadataRow as MetadataRow, MetadataSlotAllocator as MetadataSlotAllocator
from ._transfer import (
    CommitStatus as CommitStatus,
    DecodeTransferQueue as DecodeTransferQueue,
    KVSink as KVSink,
)

__all__ = (
    # synchronous core
    "KVPoll",
    "MetadataSlotAllocator",
    "MetadataRow",
    "PageAllocator",
    "PageSource",
    "AbortAckTracker",
    "DecodeRequest",
    "CommitStatus",
    "KVSink",
    "HeldRelease",
    "DeferredResolution",
    "DecodeTransferQueue",
    "PreallocRequest",
    "ResumePass",
    "RetractedRequest",
    "PreallocPass",
    "DecodePreallocQueue",
    "RunningRequest",
    "DecodeBatch",
    "FinishReason",
    "KVBackup",
    "DecodeBatchScheduler",
    # memory
    "KVPagePool",
    "MetadataSlotTable",
    "PagedKVSink",
    "kv_checksum",
    "DraftLayout",
    "DraftState",
    "PagedKVBackup",
    # async shell
    "run_decode_step",
    "run_decode_step_inline",
)

claim_exports(globals())
