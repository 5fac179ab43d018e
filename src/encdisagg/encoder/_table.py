"""The request table: every live request's record and the synchronous decisions about it.

Nothing here awaits or imports an event loop; the clock is injected. The Encoder's async
code calls these methods between its awaits, so the table is consistent at every checkpoint,
and a Hypothesis state machine drives it without an event loop (``tests/encoder``).

A record's memory may be touched only inside a *job*: :meth:`RequestRecord.enter` counts
one in, :meth:`RequestRecord.leave` counts it out and says whether the record must now be
freed. A record is freed exactly once, when release was asked for and its last job left,
so no job can ever see its memory go.
"""

from __future__ import annotations

import enum
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, Protocol

from .._errors import EncdisaggError, NotFoundError, RequestNotActiveError
from ._types import EncodeRequest, EncodeResult

__all__ = ["Cancellable", "Phase", "RequestRecord", "RequestTable", "released"]


def released(req_id: str) -> RequestNotActiveError:
    """What a call about ``req_id`` raises once its lifecycle ended."""
    return RequestNotActiveError(f"req_id {req_id!r} was released", req_id=req_id)


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Phase(enum.Enum):
    """Where a request is: its encode runs, its embedding is staged, it failed, or its
    encode was abandoned by its caller."""

    ENCODING = "encoding"
    STAGED = "staged"
    FAILED = "failed"
    #: The encode's caller left (cancelled) before it staged anything.
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class RequestRecord:
    """One live request. Mutated only on the event loop, in code that does not await.

    ``staged`` is whatever owns the staged embedding (a ``Staged``, see ``_staging/``); the
    record owns it until :meth:`RequestTable.retire`.
    """

    request: EncodeRequest
    #: ``request.req_id``, read on every step.
    req_id: str = field(init=False)
    phase: Phase = Phase.ENCODING
    #: Sticky: once set, no new sends or destination registrations are accepted.
    release_requested: bool = False
    #: Set when the request's own deadline released it.
    expired: bool = False
    #: Published as soon as preprocessing knows the sizes, before the forward ends.
    metadata: EncodeResult | None = None
    error: EncdisaggError | None = None
    staged: Any = None
    receive_count: int | None = None
    delivered: set[str] = field(default_factory=set)
    push_urls: list[str] = field(default_factory=list)
    #: Jobs in flight that may touch the staged memory (the encode job counts too).
    jobs: int = 0
    #: The jobs in flight, to cancel on expiry or shutdown.
    running: list[Cancellable] = field(default_factory=list)
    #: Absolute time (the table's clock) after which the request releases itself.
    deadline: float = math.inf
    #: Set once the record was freed and left the table.
    retired: bool = False
    #: Serialises per-send registrations of this record's memory (set by the delivery).
    fallback_lock: Any = None
    #: Set by the free when an own registration went to the region owner.
    handover: Any = None
    #: The request's encode span (an ``_tracing.Trace``) when it is traced, else None.
    trace: Any = None

    def __post_init__(self) -> None:
        self.req_id = self.request.req_id

    @property
    def accepting(self) -> bool:
        """Whether new sends and destination registrations are accepted."""
        return not self.release_requested

    def enter(self, job: Cancellable) -> None:
        """Count a job in; it is cancelled if the request expires or shuts down."""
        self.jobs += 1
        self.running.append(job)

    def leave(self, job: Cancellable) -> bool:
        """Count a job out; whether the record must be freed now."""
        self.jobs -= 1
        self.running.remove(job)
        return self.must_free()

    def must_free(self) -> bool:
        """Release was asked for, no job holds the memory, and the encode is over."""
        return (
            self.release_requested
            and self.jobs == 0
            and self.phase is not Phase.ENCODING
            and not self.retired
        )

    def request_release(self) -> bool:
        """Stop new work; whether the record must be freed now."""
        self.release_requested = True
        return self.must_free()

    def note_delivered(self, identity: str, default_count: int) -> None:
        """Count a finished destination; enough of them release the request."""
        self.delivered.add(identity)
        if len(self.delivered) >= (self.receive_count or default_count):
            self.release_requested = True

    def cancel_jobs(self) -> None:
        for job in list(self.running):
            job.cancel()


class _Retired(NamedTuple):
    expires_at: float
    error: EncdisaggError | None
    #: What remembering this entry costs (see :func:`_cost`).
    nbytes: int


#: Bytes a remembered id costs beyond its text: the dict slot, the entry, the error object.
_ENTRY_OVERHEAD: Final = 256


def _detached(error: EncdisaggError | None) -> EncdisaggError | None:
    """What is remembered of an ended request's error: its type, message and id only.

    The error that was raised holds a traceback (and maybe a cause with one), and so every
    frame it passed through with their locals: the request's body and decoded media among
    them. Remembered as it is, a refused 20 MB body would stay resident for
    ``remember_s``."""
    if error is None:
        return None
    return type(error)(error.message, req_id=error.req_id)


def _cost(req_id: str, error: EncdisaggError | None) -> int:
    """What remembering ``req_id`` (and ``error``) holds, in bytes; an estimate, but one
    that grows with the client's text (the id, the message quoting it)."""
    cost = _ENTRY_OVERHEAD + sys.getsizeof(req_id)
    if error is not None:
        cost += sys.getsizeof(error.message)
    return cost


class RequestTable:
    """Live records by ``req_id``, plus what is remembered of ended and abandoned ids.

    :param clock: the current time (the event loop's clock, or a test's).
    :param remember_s: how long an ended id is remembered (to answer 409 instead of 404,
        and to give late metadata waiters its error).
    :param abandon_ttl_s: how long an ``abandon`` of an id not seen yet is remembered.
    :param limit: at most this many ended and abandoned ids each are remembered.
    :param byte_limit: at most this many bytes (ids and error messages, see
        :attr:`remembered_bytes`) each are remembered; the oldest go first, and an entry
        larger than this on its own is not remembered at all.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        remember_s: float,
        abandon_ttl_s: float,
        limit: int = 10_000,
        byte_limit: int = 16 * 1024 * 1024,
    ) -> None:
        self._clock = clock
        self._remember_s = remember_s
        self._abandon_ttl_s = abandon_ttl_s
        self._limit = limit
        self._byte_limit = byte_limit
        self.live: dict[str, RequestRecord] = {}
        self._retired: OrderedDict[str, _Retired] = OrderedDict()
        self._abandoned: OrderedDict[str, float] = OrderedDict()
        # Invariant: the sums of _cost over _retired and over _abandoned (error None).
        self._retired_bytes = 0
        self._abandoned_bytes = 0

    @property
    def remembered(self) -> int:
        """Ended and abandoned ids remembered now. Not a checkpoint."""
        return len(self._retired) + len(self._abandoned)

    @property
    def remembered_bytes(self) -> int:
        """What the remembered ids and their errors hold, in bytes (an estimate)."""
        return self._retired_bytes + self._abandoned_bytes

    def _forget_retired(self, req_id: str) -> None:
        entry = self._retired.pop(req_id, None)
        if entry is not None:
            self._retired_bytes -= entry.nbytes

    def _forget_abandoned(self, req_id: str) -> bool:
        if self._abandoned.pop(req_id, None) is None:
            return False
        self._abandoned_bytes -= _cost(req_id, None)
        return True

    def __len__(self) -> int:
        return len(self.live)

    def get(self, req_id: str) -> RequestRecord | None:
        return self.live.get(req_id)

    def _full(self, remembered: Sized, nbytes: int) -> bool:
        return len(remembered) > self._limit or nbytes > self._byte_limit

    def _prune(self) -> None:
        """Forget the oldest ended and abandoned ids while they expired or pass a limit."""
        now = self._clock()
        retired, abandoned = self._retired, self._abandoned
        while retired and (
            next(iter(retired.values())).expires_at <= now
            or self._full(retired, self._retired_bytes)
        ):
            self._forget_retired(next(iter(retired)))
        while abandoned and (
            next(iter(abandoned.values())) <= now or self._full(abandoned, self._abandoned_bytes)
        ):
            self._forget_abandoned(next(iter(abandoned)))

    def admit(self, request: EncodeRequest) -> RequestRecord:
        """Start a fresh lifecycle for ``request.req_id``.

        :raises RequestNotActiveError: the id is live, or was abandoned before this encode
            (the abandon is used up: the id is remembered as ended).
        """
        req_id = request.req_id
        if req_id in self.live:
            raise RequestNotActiveError(f"req_id {req_id!r} is live already", req_id=req_id)
        if self._abandoned:
            self._prune()
            if self._forget_abandoned(req_id):
                self._remember(req_id, None)
                raise RequestNotActiveError(
                    f"req_id {req_id!r} was abandoned before its encode", req_id=req_id
                )
        # A reused id starts afresh: forget what its previous lifecycle left behind.
        self._forget_retired(req_id)
        record = RequestRecord(request)
        self.live[req_id] = record
        return record

    def lookup(self, req_id: str) -> RequestRecord:
        """The record of a live request that accepts new work.

        :raises NotFoundError: the id is unknown.
        :raises RequestNotActiveError: it ended or is being released.
        """
        record = self.live.get(req_id)
        if record is None:
            if self.ended(req_id):
                raise released(req_id)
            raise NotFoundError(f"req_id {req_id!r} is unknown", req_id=req_id)
        if record.release_requested:
            raise RequestNotActiveError(f"req_id {req_id!r} is being released", req_id=req_id)
        return record

    def ended(self, req_id: str) -> bool:
        """Whether ``req_id`` is not live but ended recently."""
        self._prune()
        return req_id in self._retired

    def ended_error(self, req_id: str) -> EncdisaggError | None:
        """The error a recently ended ``req_id`` failed with, if any."""
        self._prune()
        entry = self._retired.get(req_id)
        return None if entry is None else entry.error

    def retire(self, record: RequestRecord) -> None:
        """Forget a freed record; remember its id (and error) for late callers."""
        record.retired = True
        if self.live.get(record.req_id) is record:
            del self.live[record.req_id]
            self._remember(record.req_id, record.error)

    def _remember(self, req_id: str, error: EncdisaggError | None) -> None:
        retired = self._retired
        self._forget_retired(req_id)
        error = _detached(error)
        cost = _cost(req_id, error)
        if cost > self._byte_limit:
            return
        retired[req_id] = _Retired(self._clock() + self._remember_s, error, cost)
        self._retired_bytes += cost
        while self._full(retired, self._retired_bytes):
            # Full: the oldest go (entries are in expiry order, all with one lifetime).
            self._forget_retired(next(iter(retired)))

    def abandon(self, req_id: str) -> RequestRecord | None:
        """Mark ``req_id`` for release: the live record to release, else None.

        An id that ended recently is left alone (a late release of that lifecycle must not
        refuse the retry that follows it); an id never seen is remembered for
        ``abandon_ttl_s`` and refused by the encode that would create it.
        """
        record = self.live.get(req_id)
        if record is not None:
            return record
        if self.ended(req_id):
            return None
        cost = _cost(req_id, None)
        self._forget_abandoned(req_id)
        if cost <= self._byte_limit:
            self._abandoned[req_id] = self._clock() + self._abandon_ttl_s
            self._abandoned_bytes += cost
            if self._full(self._abandoned, self._abandoned_bytes):
                self._prune()
        return None

    def abandoned(self, req_id: str) -> bool:
        self._prune()
        return req_id in self._abandoned
