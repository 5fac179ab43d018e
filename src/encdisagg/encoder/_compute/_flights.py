"""Single-flight: concurrent encodes of the same content share one preprocess and forward.

A request whose every item carries its content (bytes, a ``data:`` URL, a single-frame PIL
image, ``{"url", "content_hash"}``) has a *flight key*: its modality and each item's content
digest (:func:`~encdisagg.cache.content_digest`, the digest the cache keys are built from).
The first request with a key *leads*: it starts the shared work (preprocess, cache lookup,
forward, cache insert) as a task of the Encoder's own task group, not in its own scope. Every
request with the same key that arrives before that work ended *joins* it. All of them wait
for the same outcome, and each then stages its own embedding.

The rules, decided in :class:`FlightTable` (synchronous, never awaits):

- a waiter that is cancelled (or cut short by its deadline or a release) leaves at once; the
  work goes on for the others, whoever started it;
- the last waiter to leave unfinished work cancels it and waits (shielded) until it stopped,
  as a lone request waits for its own work; the flight leaves the table at that moment, so a
  request arriving later starts afresh;
- a finished flight leaves the table; later requests find its result in the cache (if on);
- a failure reaches every waiter still there, each as its own exception naming its own id.

Memory: the shared rows are read-only. The first waiter to take them stages them as a lone
request would (no copy unless they are a cache entry); every later waiter stages a copy, so
no two requests ever stage the same memory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import anyio
import torch

from ..._errors import EncdisaggError, InternalError, ServiceUnavailableError
from ...cache import content_digest
from ...models import Preprocessed
from ...nurseries import run_thread_to_completion

if TYPE_CHECKING:
    from ... import _tracing
    from ...nurseries import ServiceTaskGroup
    from .._events import EncoderEvents
    from .._types import EncodeRequest

__all__ = ["Flight", "FlightKey", "FlightSignals", "FlightTable", "SharedEncodes", "flight_key"]

#: ``(modality, digest of item 0, digest of item 1, ...)``.
FlightKey = tuple[str, ...]
OnPreprocessed = Callable[[Preprocessed], None]
#: The work of one request: ``(request, on_preprocessed, trace, digests)`` →
#: ``(rows, preprocessed, rows_are_shared)``.
Work = Callable[
    ["EncodeRequest", OnPreprocessed, "_tracing.Trace | None", "Sequence[str] | None"],
    Awaitable[tuple[torch.Tensor, Preprocessed, bool]],
]

#: Items up to this size are hashed on the event loop; a larger one, or a PIL image, makes
#: the whole request's key be computed in a worker thread.
_HASH_INLINE_BYTES: Final = 64 * 1024


def flight_key(items: Sequence[object], modality: str, *, max_media_bytes: int) -> FlightKey | None:
    """The flight key of a request's items, or ``None`` if any item does not carry its
    content (a file path, an http URL: reading it is the preprocessing's job). Blocks while
    hashing. Caller-supplied ``hashes`` are not used: a wrong one must not hand one
    request's embedding to another."""
    digests = []
    for item in items:
        digest = content_digest(item, max_media_bytes=max_media_bytes)
        if digest is None:
            return None
        digests.append(digest)
    return (modality, *digests)


def _hash_in_thread(items: Sequence[object]) -> bool:
    """Whether keying ``items`` hashes enough bytes to hold up the event loop."""
    for item in items:
        if isinstance(item, (bytes, bytearray, memoryview, str)):
            if len(item) > _HASH_INLINE_BYTES:
                return True
        elif type(item).__module__.startswith("PIL."):
            return True  # its pixels are decoded and hashed
    return False


@dataclass(eq=False, slots=True)
class FlightSignals:
    """What a flight's waiters and work await (made on the event loop, by its leader)."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    #: Set once preprocessing is done (or the work ended): early metadata for every waiter.
    preprocessed: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(eq=False, slots=True)
class Flight:
    """One shared encode: its waiters and, once it ended, its outcome."""

    key: FlightKey
    #: The request the work runs as (its id is in the work's own error messages).
    leader: str
    signals: FlightSignals | None = None
    waiters: int = 1
    #: The work ended (with rows, an error, or cancelled).
    ended: bool = False
    pre: Preprocessed | None = None
    rows: torch.Tensor | None = None
    #: The rows are a cache entry (every taker copies them).
    cached: bool = False
    #: Someone took the rows as their own: later takers copy them.
    taken: bool = False
    error: Exception | None = None
    error_raised: bool = False

    def outcome(self, req_id: str) -> tuple[torch.Tensor, Preprocessed, bool]:
        """What the waiter ``req_id`` gets: ``(rows, preprocessed, copy)``, where ``copy``
        says it must stage a copy. Not a checkpoint.

        :raises EncdisaggError: the work's error (the leader's own exception the first time
            it asks, else a copy naming ``req_id``); ``ServiceUnavailableError`` if the work
            was cut short by the encoder's close.
        """
        if self.error is not None:
            if req_id == self.leader and not self.error_raised:
                self.error_raised = True
                raise self.error
            raise _error_for(self.error, self.leader, req_id)
        if self.rows is None or self.pre is None:
            raise ServiceUnavailableError("the encoder is shutting down", req_id=req_id)
        copy = self.cached or self.taken
        self.taken = True
        return self.rows, self.pre, copy


def _error_for(error: Exception, leader: str, req_id: str) -> Exception:
    """A fresh exception for another waiter: one exception object must not be raised in
    several tasks (their tracebacks would pile up on it)."""
    if isinstance(error, EncdisaggError):
        message = error.message.replace(f"req_id {leader!r}", f"req_id {req_id!r}")
        try:
            copy: Exception = type(error)(message, req_id=req_id)
        except TypeError:  # a subclass with another constructor
            copy = InternalError(f"req_id {req_id!r}: {message}", req_id=req_id)
        copy.__cause__ = error.__cause__
        return copy
    copy = InternalError(f"req_id {req_id!r}: encoding failed: {error!r}", req_id=req_id)
    copy.__cause__ = error
    return copy


class FlightTable:
    """The flights in progress, by key. Every method is synchronous and never awaits."""

    def __init__(self) -> None:
        self._flights: dict[FlightKey, Flight] = {}
        #: Flights started and requests that joined one, since the Encoder opened.
        self.started = 0
        self.joined = 0

    def __len__(self) -> int:
        return len(self._flights)

    def join(self, key: FlightKey, req_id: str) -> tuple[Flight, bool]:
        """The flight of ``key`` and whether the caller leads it (it must start the work)."""
        flight = self._flights.get(key)
        if flight is not None:
            flight.waiters += 1
            self.joined += 1
            return flight, False
        flight = self._flights[key] = Flight(key, req_id)
        self.started += 1
        return flight, True

    def leave(self, flight: Flight) -> bool:
        """A waiter stops waiting. Returns True if it was the last one and the work has not
        ended: the caller must cancel the work. The flight is then out of the table."""
        flight.waiters -= 1
        if flight.waiters > 0 or flight.ended:
            return False
        self._forget(flight)
        return True

    def finish(self, flight: Flight) -> None:
        """The work ended (with rows, an error, or cancelled)."""
        flight.ended = True
        self._forget(flight)

    def _forget(self, flight: Flight) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]


class SharedEncodes:
    """Runs requests' work, shared between requests of one flight key.

    Until :meth:`bind` gives it a task group, every request runs its own work.

    :param work: one request's whole compute (preprocess through cache insert).
    :param max_media_bytes: items larger than this are never keyed (preprocessing refuses
        them as it would anyway).
    """

    def __init__(self, work: Work, *, events: EncoderEvents, max_media_bytes: int) -> None:
        self._work = work
        self._events = events
        self._max_media_bytes = max_media_bytes
        self.table = FlightTable()
        self._group: ServiceTaskGroup | None = None

    def bind(self, group: ServiceTaskGroup) -> None:
        """Run shared work in ``group``, which must outlive every request."""
        self._group = group

    async def run(
        self,
        request: EncodeRequest,
        on_preprocessed: OnPreprocessed,
        trace: _tracing.Trace | None,
    ) -> tuple[torch.Tensor, Preprocessed, bool]:
        """``request``'s ``(rows, preprocessed, copy)``: ``copy`` says the rows are shared
        (with the cache or with another request) and must be copied before staging.

        A checkpoint. ``on_preprocessed`` is called in the caller's task once preprocessing
        is done. Cancelled, the caller leaves at once unless it is the last waiter of
        unfinished shared work: it then cancels the work and returns once it stopped.
        """
        key = await self._key(request) if self._group is not None else None
        if key is None:
            return await self._work(request, on_preprocessed, trace, None)
        flight, leads = self.table.join(key, request.req_id)
        if leads:
            assert self._group is not None
            flight.signals = FlightSignals()
            try:
                self._group.start_soon(
                    self._fly, flight, request, trace, name=f"shared encode of {request.req_id!r}"
                )
            except RuntimeError:  # the group closed: the encoder is shutting down
                self.table.finish(flight)
                raise ServiceUnavailableError(
                    "the encoder is shutting down", req_id=request.req_id
                ) from None
        else:
            self._events.cache("joined")
        signals = flight.signals
        assert signals is not None
        try:
            await signals.preprocessed.wait()
            if flight.pre is not None:
                on_preprocessed(flight.pre)
            await signals.done.wait()
        except BaseException:
            if self.table.leave(flight):
                signals.scope.cancel()
                # As a lone request's own work would: nothing it started runs on after it.
                with anyio.CancelScope(shield=True):
                    await signals.done.wait()
            raise
        self.table.leave(flight)
        return flight.outcome(request.req_id)

    async def _key(self, request: EncodeRequest) -> FlightKey | None:
        items, modality = request.items, request.kind.value
        if not _hash_in_thread(items):
            return flight_key(items, modality, max_media_bytes=self._max_media_bytes)
        return await run_thread_to_completion(
            lambda: flight_key(items, modality, max_media_bytes=self._max_media_bytes)
        )

    async def _fly(
        self, flight: Flight, request: EncodeRequest, trace: _tracing.Trace | None
    ) -> None:
        """The shared work, a task of the bound group. Never raises but cancellation: its
        outcome is its waiters' to see."""
        signals = flight.signals
        assert signals is not None

        def publish(pre: Preprocessed) -> None:
            flight.pre = pre
            signals.preprocessed.set()

        try:
            with signals.scope:
                rows, pre, cached = await self._work(request, publish, trace, flight.key[1:])
                flight.rows, flight.pre, flight.cached = rows, pre, cached
        except Exception as exc:
            flight.error = exc
        finally:
            self.table.finish(flight)
            signals.preprocessed.set()
            signals.done.set()
