"""The prefill worker's records: a pipeline request, how it went, the worker's statistics,
and how an abort from decode reaches a request, running (:class:`PrefillJob`) or not started
yet (:class:`AbortTombstones`)."""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import anyio

if TYPE_CHECKING:
    from ._lm import PrefillResult
    from ._pd_messages import KVDestination

__all__ = [
    "AbortTombstones",
    "PipelineRequest",
    "PrefillJob",
    "PrefillReport",
    "PrefillStats",
    "PrefillStatus",
]

#: Aborts remembered for requests that have not started here yet.
_TOMBSTONES: Final = 10_000


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


@dataclass(eq=False)
class PrefillJob:
    """One request running on the prefill worker (identity equality)."""

    request: PipelineRequest
    #: Cancelled by an abort while nothing is being written.
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    aborted: bool = False
    #: The generation of decode's abort, once one carried it: ack it after the last write.
    generation: int | None = None
    destination: KVDestination | None = None
    destination_ready: anyio.Event = field(default_factory=anyio.Event)
    #: True while the write thread runs: then an abort only raises ``stop``.
    writing: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    #: How far it got, for its report: when it started and reached each step
    #: (``anyio.current_time()`` readings, by step: ``embedded``, ``prefilled``, ``written``),
    #: its prefill's result and the tokens each image took.
    started_at: float = field(default_factory=anyio.current_time)
    times: dict[str, float] = field(default_factory=dict)
    result: PrefillResult | None = None
    image_tokens: tuple[int, ...] = ()

    def abort(self, generation: int | None) -> None:
        """Stop the request: between pages if the write thread runs, else at once.

        ``generation`` (if not ``None``) is the abort's, to be acked once the last write
        returned.
        """
        self.aborted = True
        if generation is not None:
            self.generation = generation
        self.stop.set()
        if not self.writing:
            self.scope.cancel()


class AbortTombstones:
    """Rooms aborted before they started here; bounded (the oldest are forgotten first).

    Such an abort carries no generation: decode had handed out no pages for the room yet
    (an abort with one, for a room not running here, is acked at once instead).
    """

    def __init__(self) -> None:
        self._rooms: OrderedDict[int, None] = OrderedDict()

    def remember(self, room: int) -> None:
        self._rooms[room] = None
        while len(self._rooms) > _TOMBSTONES:
            self._rooms.popitem(last=False)

    def forget(self, room: int) -> bool:
        """Forget the abort of ``room``; returns whether one was remembered."""
        if room not in self._rooms:
            return False
        del self._rooms[room]
        return True
