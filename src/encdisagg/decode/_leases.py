"""The async shell: a decode request's KV pages owned by a scope that drains before freeing.

A :class:`KVLease` is the pages (and metadata slot) of one decode request, held by an
:class:`~encdisagg.nurseries.OwningScope`. The scope ends only after every task started in it
returned, and then frees the pages, but not before the prefill side can no longer write into
them: if an abort was sent, the exit waits, shielded and bounded, for every prefill rank's
drained-ack of that abort's generation.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio

from .._errors import RequestNotActiveError, ServiceUnavailableError
from ..nurseries import OwningScope, collapse_single_error, open_owning_scope
from ._drain import DrainAcks
from ._pages import PageSource
from ._slots import MetadataSlotAllocator

__all__ = ["AbortSender", "DecodeKVLeases", "KVLease", "LeaseState"]

_log = logging.getLogger("encdisagg.decode")


class LeaseState(enum.Enum):
    """Who may still write into a lease's pages. It only moves forward."""

    #: Pages taken, not yet handed to the prefill side: nobody can write into them.
    RESERVED = "reserved"
    #: The pages' addresses went to the prefill side: writes may land at any time.
    EXPOSED = "exposed"
    #: The transfer concluded: every writer is done.
    COMPLETE = "complete"
    #: The prefill ranks were told to stop; their drained-acks release the pages.
    ABORTED = "aborted"
    #: The scope ended; waiting (if needed) and freeing.
    RELEASING = "releasing"
    #: Pages and slot are free.
    RELEASED = "released"


class KVLease:
    """The KV pages and metadata slot of one decode request.

    Made by :meth:`DecodeKVLeases.lease`; its state methods are synchronous and never
    checkpoint. Start tasks that use the pages in :attr:`scope` (``lease.scope.start_soon``):
    the pages outlive them.
    """

    def __init__(
        self, rid: str, room: int, required_acks: int, release_timeout_s: float, drains: DrainAcks
    ) -> None:
        self.rid = rid
        self.room = room
        self.required_acks = required_acks
        self.release_timeout_s = release_timeout_s
        self.pages: tuple[int, ...] = ()
        self.metadata_slot: int | None = None
        #: The generation of the abort sent for this lease, once there is one.
        self.generation: int | None = None
        #: True if the pages were freed because the wait for drained-acks timed out.
        self.timed_out = False
        self._state = LeaseState.RESERVED
        self._drain_deadline = math.inf
        self._scope: OwningScope[KVLease] | None = None
        self._drains = drains

    @property
    def state(self) -> LeaseState:
        return self._state

    @property
    def scope(self) -> OwningScope[KVLease]:
        """The scope that owns the pages."""
        if self._scope is None:
            raise RequestNotActiveError(f"lease of {self.rid!r} is not open", req_id=self.rid)
        return self._scope

    def _require_open(self) -> None:
        if self._state in (LeaseState.RELEASING, LeaseState.RELEASED):
            raise RequestNotActiveError(
                f"lease of {self.rid!r} is {self._state.value}", req_id=self.rid
            )

    def expose(self) -> None:
        """Mark the pages as handed to the prefill side. Idempotent.

        From here on a write may land at any time, so the exit frees the pages only once the
        writers are known to be done (:meth:`complete`, drained-acks, or the timeout).

        :raises RequestNotActiveError: after the transfer concluded, was aborted, or the
            lease ended.
        """
        self._require_open()
        if self._state is LeaseState.RESERVED:
            self._state = LeaseState.EXPOSED
        elif self._state is not LeaseState.EXPOSED:
            raise RequestNotActiveError(
                f"lease of {self.rid!r} is {self._state.value}", req_id=self.rid
            )

    def complete(self) -> None:
        """Mark the transfer as concluded: every prefill rank reported its writes done.

        After an abort this changes nothing: the abort's acks still decide.
        """
        self._require_open()
        if self._state in (LeaseState.RESERVED, LeaseState.EXPOSED):
            self._state = LeaseState.COMPLETE

    def abort(self) -> int | None:
        """Arm the drain count for this lease's room and return the abort's generation.

        Call it *before* sending the abort to the prefill ranks and put the generation into
        the message: an ack that races ahead of anything else is then still counted. The wait
        for acks is bounded by ``release_timeout_s`` from this call. Idempotent: a second
        call returns the same generation.

        :return: the generation, or ``None`` if no write can be in flight (the pages were
            never exposed, or the transfer completed) and nobody needs to be told.
        """
        self._require_open()
        if self._state is LeaseState.ABORTED:
            return self.generation
        if self._state is not LeaseState.EXPOSED:
            return None
        return self._arm()

    def _arm(self) -> int:
        self.generation = self._drains.arm(self.room)
        self._drain_deadline = anyio.current_time() + self.release_timeout_s
        self._state = LeaseState.ABORTED
        return self.generation


#: Sends the abort for a lease to its prefill ranks (``lease.room``, ``lease.generation``).
AbortSender = Callable[[KVLease], Awaitable[object]]


class DecodeKVLeases:
    """Leases decode KV pages to requests and frees them only after the writers drained.

    :param pages: where pages come from (a :class:`KVPagePool` or a :class:`PageAllocator`).
    :param slots: metadata slots; each lease takes one when given (zeroed before freed when
        the allocator has a ``zero_slot`` hook).
    :param drains: the drained-ack counter; a new one if omitted.
    :param release_timeout_s: how long a lease waits for drained-acks at most.
    :param send_abort: when a lease ends while its pages are exposed (its block raised or was
        cancelled mid-transfer), it is armed and this is awaited to tell the prefill ranks;
        without it the lease holds its pages for the whole timeout, since nobody will ack.

    Feed every drained-ack from the prefill side into :meth:`ack`.
    """

    def __init__(
        self,
        pages: PageSource,
        *,
        slots: MetadataSlotAllocator | None = None,
        drains: DrainAcks | None = None,
        release_timeout_s: float = 30.0,
        send_abort: AbortSender | None = None,
    ) -> None:
        if not release_timeout_s >= 0:
            raise ValueError(f"release_timeout_s must be >= 0, got {release_timeout_s!r}")
        self.pages = pages
        self.slots = slots
        self.drains = drains if drains is not None else DrainAcks()
        self.release_timeout_s = release_timeout_s
        self._send_abort = send_abort
        #: Leases open right now.
        self.active = 0
        #: Leases whose exit is waiting for drained-acks right now.
        self.draining = 0
        #: Leases freed because their wait for acks timed out.
        self.timeouts = 0

    def ack(self, room: int, rank: int, generation: int) -> bool:
        """Record prefill rank ``rank``'s drained-ack for ``generation`` of ``room``.

        Synchronous; wakes the lease waiting for it. Returns ``False`` if dropped.
        """
        return self.drains.ack(room, rank, generation)

    @asynccontextmanager
    async def lease(
        self, rid: str, room: int, *, num_pages: int, required_acks: int
    ) -> AsyncIterator[KVLease]:
        """Take ``num_pages`` pages (and a metadata slot) for request ``rid``.

        Entering is a checkpoint. On exit the lease's scope winds down (if the block raised
        or was cancelled, the tasks in :attr:`KVLease.scope` are cancelled), then the pages
        are freed once nobody can write into them:

        - never exposed, or completed: at once;
        - aborted (:meth:`KVLease.abort`): once ``required_acks`` distinct ranks acked the
          abort's generation, or ``release_timeout_s`` after the abort;
        - still exposed: armed and ``send_abort`` awaited, then as above; without
          ``send_abort``, after ``release_timeout_s``.

        This wait is shielded: cancelling the caller (once or many times) does not shorten
        it, and the cancellation is delivered after the pages are freed. A single error from
        the block or the release leaves ``async with`` as itself, not in a group.

        :raises ServiceUnavailableError: if there are not enough free pages or no free slot.
        """
        lease = KVLease(rid, room, required_acks, self.release_timeout_s, self.drains)

        async def acquire() -> KVLease:
            pages = self.pages.alloc(num_pages)
            if pages is None:
                raise ServiceUnavailableError(
                    f"no room for request {rid!r}: it needs {num_pages} KV pages, "
                    f"{self.pages.available()} are free",
                    req_id=rid,
                )
            if self.slots is not None:
                slot = self.slots.alloc()
                if slot is None:
                    self.pages.free(pages)
                    raise ServiceUnavailableError(
                        f"no free metadata slot for request {rid!r}", req_id=rid
                    )
                lease.metadata_slot = slot
            lease.pages = tuple(pages)
            self.active += 1
            return lease

        with collapse_single_error():
            async with open_owning_scope(
                acquire,
                self._release,
                name=f"KV lease of {rid!r}",
                # Every await in _release is bounded by the lease's own drain deadline.
                cleanup_timeout=math.inf,
            ) as scope:
                lease._scope = scope
                yield lease

    async def _release(self, lease: KVLease) -> None:
        state = lease._state
        send_abort = self._send_abort
        try:
            if state is LeaseState.EXPOSED and send_abort is not None:
                # Ended mid-transfer: tell the prefill ranks, then wait for them as for an
                # explicit abort. Armed first, so an ack that beats the send is counted.
                lease._arm()
                lease._state = LeaseState.RELEASING
                with anyio.CancelScope(deadline=lease._drain_deadline):
                    try:
                        await send_abort(lease)
                    except Exception:
                        # Some ranks may have been told and may still ack: keep waiting.
                        _log.exception("sending the abort for request %r failed", lease.rid)
                await self._hold_until(lease, lease._drain_deadline)
                return
            lease._state = LeaseState.RELEASING
            if state is LeaseState.EXPOSED:
                await self._hold_until(lease, anyio.current_time() + lease.release_timeout_s)
            elif state is LeaseState.ABORTED:
                await self._hold_until(lease, lease._drain_deadline)
        finally:
            self._free(lease)

    async def _hold_until(self, lease: KVLease, deadline: float) -> None:
        """Wait until the lease's writers drained, or ``deadline``."""
        generation = lease.generation
        if generation is not None and self.drains.tracker.is_release_safe(
            lease.room, lease.required_acks, generation=generation
        ):
            return
        self.draining += 1
        try:
            with anyio.CancelScope(deadline=deadline) as bound:
                if generation is None:
                    # Exposed, but nobody was told to stop: no ack will come.
                    await anyio.sleep_forever()
                else:
                    await self.drains.wait_drained(lease.room, generation, lease.required_acks)
        finally:
            self.draining -= 1
        if bound.cancelled_caught:
            lease.timed_out = True
            self.timeouts += 1
            _log.warning(
                "freeing KV pages of request %r (room %d) without all drained-acks after "
                "%.1f s: a late write could still land",
                lease.rid,
                lease.room,
                lease.release_timeout_s,
            )

    def _free(self, lease: KVLease) -> None:
        pages, lease.pages = lease.pages, ()
        slot, lease.metadata_slot = lease.metadata_slot, None
        try:
            self.pages.free(pages)
        finally:
            try:
                if slot is not None and self.slots is not None:
                    self.slots.free(slot)
            finally:
                if lease.generation is not None:
                    self.drains.clear(lease.room, generation=lease.generation)
                lease._state = LeaseState.RELEASED
                self.active -= 1
