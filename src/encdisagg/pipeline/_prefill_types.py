"""The prefill worker's records: a pipeline request, how it went, the worker's statistics."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["PipelineRequest", "PrefillReport", "PrefillStats", "PrefillStatus"]


@dataclass(frozen=True, slots=True)
class PipelineRequest:
    """One request of the pipeline: a prompt about some images."""

    rid: str
    #: The bootstrap room prefill and decode know the request by (unique, non-zero).
    room: int
    prompt: str
    #: Media items the encoders accept (data URLs, base64, URLs they may fetch).
    images: tuple[str, ...]
    max_new_tokens: int


class PrefillStatus(enum.Enum):
    #: Every KV byte and the metadata row landed in decode's memory.
    DONE = "done"
    #: Decode aborted; writes stopped and (if pages were out) the drain was acked.
    ABORTED = "aborted"
    #: Something failed here; decode was told.
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PrefillReport:
    """How a request went on the prefill side. Times are ``anyio.current_time()`` readings."""

    rid: str
    status: PrefillStatus
    error: str = ""
    seq_len: int = 0
    first_token: int = 0
    #: Checksum of the KV pages as written (what decode must find).
    checksum: int = 0
    image_tokens: tuple[int, ...] = ()
    started_at: float = 0.0
    embedded_at: float | None = None
    prefilled_at: float | None = None
    written_at: float | None = None


@dataclass(frozen=True, slots=True)
class PrefillStats:
    """A snapshot of the worker. ``live`` is zero and the free counts equal their totals
    when it is idle."""

    live: int
    done: int
    aborted: int
    failed: int
    #: Aborts that found the write thread running: it stopped between pages.
    writes_stopped: int
    #: Drained-acks sent, each after its request's last write returned.
    acks_sent: int
    staging_pages_free: int
    staging_pages: int
    staging_rows_free: int
    staging_rows: int
