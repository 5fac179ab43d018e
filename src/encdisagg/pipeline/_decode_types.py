"""The decode worker's records: where a request is, how it ended, the worker's statistics,
and the per-request state the scheduler keeps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import anyio

from ..decode import DecodeRequest, RunningRequest

__all__ = ["DecodeJob", "DecodePhase", "DecodeResult", "DecodeStats", "DecodeStatus"]


class DecodePhase(enum.IntEnum):
    """Where a decode request is. It only moves forward."""

    #: Registered; prefill has not said how long the prompt is.
    WAITING = 0
    #: Waiting for KV pages and a metadata slot.
    PREALLOC = 1
    #: Pages handed to prefill: KV may land at any time.
    TRANSFER = 2
    #: KV committed; decoding.
    DECODING = 3
    #: Finished (its pages may still be held, see the transfer queue).
    DONE = 4


class DecodeStatus(enum.Enum):
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """How a decode request ended."""

    rid: str
    status: DecodeStatus
    tokens: tuple[int, ...] = ()
    error: str = ""
    #: The checksum of the committed KV (as written by prefill, verified on the pages).
    checksum: int = 0
    #: Clock readings (``anyio.current_time()``): registered, first token known, finished.
    started_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float = 0.0
    #: The first token's top-k ``(id, logprob)``, from the draft state prefill shipped.
    first_top: tuple[tuple[int, float], ...] = ()
    #: How often the request was retracted (its KV backed up and reloaded) while decoding.
    retractions: int = 0


@dataclass(frozen=True, slots=True)
class DecodeStats:
    """A snapshot of the worker. The first six are zero when it is idle, and ``pages_free``
    / ``slots_free`` equal their totals less the retired requests' (``retired_pages``,
    ``retired``: out of use, not leaked). ``decoding`` counts requests in the batch
    scheduler: waiting, running or retracted. ``leaked_pages`` counts pages in use that no
    live, held or retired request owns: anything but zero is a bug."""

    live: int
    prealloc_queued: int
    transfer_queued: int
    held: int
    decoding: int
    leaked_pages: int
    pages_free: int
    pages_total: int
    slots_free: int
    slots_total: int
    completed: int
    aborted: int
    failed: int
    corrupt: int
    held_releases: int
    drained_releases: int
    timed_out_releases: int
    release_failures: int
    #: Batched decode steps run, requests retracted and resumed under memory pressure.
    decode_steps: int = 0
    retractions: int = 0
    resumptions: int = 0
    #: Draft states whose hidden state did not predict their first token (counted corrupt).
    draft_mismatches: int = 0
    #: Seconds spent in batched decode steps and the tokens they produced: their ratio is
    #: the decode side's throughput while it works.
    step_seconds: float = 0.0
    step_tokens: int = 0
    #: Pages of the held requests (``held``): out of use until their acks or deadline.
    held_pages: int = 0
    #: Retired requests (``HoldPolicy.RETIRE``: their deadline passed without every ack),
    #: each keeping its pages and its metadata slot out of use until its acks arrive.
    retired: int = 0
    retired_pages: int = 0
    #: Requests retired in all (each also counted once drained, if its acks came late).
    retirements: int = 0
    #: Bytes of the held and retired requests' pages.
    held_bytes: int = 0


@dataclass(eq=False)
class DecodeJob:
    """One admitted request as the scheduler tracks it, from admission to its result."""

    rid: str
    room: int
    max_new_tokens: int
    started_at: float
    phase: DecodePhase = DecodePhase.WAITING
    aborted: bool = False
    req: DecodeRequest | None = None
    seq_len: int = 0
    rope_delta: int = 0
    checksum: int = 0
    first_token: int = 0
    first_token_at: float | None = None
    #: Why prefill failed the request, if it did.
    error: str = ""
    result: DecodeResult | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    phase_changed: anyio.Event = field(default_factory=anyio.Event)
    #: Its place in the batch scheduler, once its KV was committed.
    running: RunningRequest | None = None
    first_top: tuple[tuple[int, float], ...] = ()
    retractions: int = 0

    def advance(self, phase: DecodePhase) -> None:
        self.phase = phase
        self.phase_changed.set()
        self.phase_changed = anyio.Event()
