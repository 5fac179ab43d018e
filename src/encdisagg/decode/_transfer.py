"""The transfer queue: decode requests whose KV is being written by the prefill side.

Everything here is synchronous and never awaits: a scheduler loop calls ``pop_transferred``
and ``resolve_deferred_releases`` between forwards, and the property tests drive it without
an event loop.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from .._errors import InternalError
from .._numbers import real, whole
from ..transfer import HeldLedger, Hold, HoldPolicy
from ._acks import AbortAckTracker
from ._deferred import DeferredResolution, HeldRelease, log_retired, log_reused
from ._poll import KVPoll
from ._request import DecodeRequest
from ._slots import MetadataSlotAllocator

__all__ = [
    "CommitStatus",
    "DecodeTransferQueue",
    "KVSink",
]

_log = logging.getLogger("encdisagg.decode")


class CommitStatus(enum.Enum):
    """What committing a transferred request's KV found."""

    #: The KV and the metadata row are the request's own: it may start decoding.
    COMMITTED = "committed"
    #: Every rank reported success, but the metadata row has not landed yet: poll again.
    NOT_READY = "not_ready"
    #: The metadata row belongs to another request or fails its checksum: abort.
    CORRUPT = "corrupt"


class KVSink(Protocol):
    """Where a :class:`DecodeTransferQueue` hands requests' KV. All calls are synchronous.

    ``hold`` has a default (do nothing), which a sink gets by subclassing this protocol.
    """

    def commit(self, req: DecodeRequest) -> CommitStatus:
        """Validate the landed KV and metadata of ``req`` and adopt them for decoding."""
        ...

    def release(self, req: DecodeRequest) -> None:
        """Free the KV pages of ``req``. May raise; the queue never calls it twice."""
        ...

    def abort(self, req: DecodeRequest, message: str) -> None:
        """Finish ``req`` with an error ``message`` (tell the client)."""
        ...

    def hold(self, req: DecodeRequest, hold: Hold) -> None:
        """The queue holds ``req``: a prefill write may still land in its pages and slot until
        ``hold`` settles. A sink that must keep that memory registered and alive through the
        hold does so here (:class:`PagedKVSink` does); by default nothing: the queue keeps
        the pages out of use itself."""
        return None


_NOTHING_RESOLVED = DeferredResolution()


class DecodeTransferQueue:
    """Requests waiting for their KV, and failed ones whose pages are held back.

    :param kv: commits, releases and aborts requests.
    :param slots: the metadata slots; each request's slot is freed here, exactly once. Give
        the allocator a ``zero_slot`` hook so each slot is zeroed before it is freed.
    :param acks: drained-acks of aborted requests.
    :param release_timeout_s: how long a held request waits for its acks before
        ``on_timeout`` decides what becomes of it.
    :param clock: the time source for hold deadlines (seconds, monotonic).
    :param on_timeout: what becomes of a held request whose deadline passed without every
        ack: :attr:`HoldPolicy.REUSE` (the default, SGLang's behaviour) releases its pages
        and slot, and a late write may land in another request's memory;
        :attr:`HoldPolicy.RETIRE` *retires* it: its pages and slot stay out of use (neither
        released nor freed, counted in :attr:`retired`) until a complete set of acks for its
        generation arrives after all, or for good. A policy's name (``"retire"``) works too.
    :param page_bytes: bytes per KV page, so that :attr:`held_bytes` counts bytes; with the
        default ``0`` the holds count pages only (:attr:`held_pages`, :attr:`retired_pages`).

    **Holds.** Each held request carries a :class:`~encdisagg.transfer.Hold`
    (:attr:`HeldRelease.hold`), counted in :attr:`ledger` with ``len(req.pages) *
    page_bytes`` bytes and logged once, and handed to the sink's ``hold`` if it has one. Its
    acks settle it; so does ``REUSE`` at the deadline, by policy; nothing else does.

    **Who arms.** The code that sends the abort to the prefill ranks arms the room first
    (``req.generation = acks.arm(req.room)``), puts the generation into the abort message,
    and sets ``req.abort_notified`` once the message is out. Arming before sending means an
    ack that races ahead of the scheduler is still counted. If a request arrives at the hold
    with ``abort_notified`` set but no ``generation``, the queue adopts the room's current
    generation when the room is armed and no other held request owns that generation, and
    otherwise arms the room itself; acks sent before that are lost and the request waits for
    its deadline.
    """

    def __init__(
        self,
        *,
        kv: KVSink,
        slots: MetadataSlotAllocator,
        acks: AbortAckTracker,
        release_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_timeout: HoldPolicy | str = HoldPolicy.REUSE,
        page_bytes: int = 0,
    ) -> None:
        real("release_timeout_s", release_timeout_s, least=0, finite=False)
        whole("page_bytes", page_bytes)
        self.kv = kv
        self.slots = slots
        self.acks = acks
        self.release_timeout_s = release_timeout_s
        self.on_timeout = HoldPolicy.parse(on_timeout, field="on_timeout")
        self.page_bytes = page_bytes
        self._clock = clock
        #: Requests whose transfer is pending, in arrival order.
        self.queue: list[DecodeRequest] = []
        #: The holds of the held and retired requests: how many, and their bytes.
        self.ledger = HeldLedger("decode KV")
        # Held and retired entries, in the order they were held.
        self._entries: list[HeldRelease] = []
        #: How many ``kv.release`` calls raised (each logged, none retried).
        self.release_failures = 0

    # -- views ---------------------------------------------------------------------------------

    @property
    def deferred(self) -> list[DecodeRequest]:
        """The held requests still waiting for their acks or deadline, oldest first (a
        snapshot; retired ones are in :attr:`retired`)."""
        return [entry.req for entry in self.held]

    @property
    def held(self) -> tuple[HeldRelease, ...]:
        """The entries of :attr:`deferred`, with their generations and deadlines."""
        return tuple(entry for entry in self._entries if entry.retired_at is None)

    @property
    def retired(self) -> tuple[HeldRelease, ...]:
        """The retired entries, oldest first: their pages and slots are out of use until
        their acks arrive (``HoldPolicy.RETIRE`` only)."""
        return tuple(entry for entry in self._entries if entry.retired_at is not None)

    @property
    def held_pages(self) -> int:
        """Pages of the requests in :attr:`deferred`."""
        return sum(len(entry.req.pages) for entry in self.held)

    @property
    def retired_pages(self) -> int:
        """Pages of the retired requests."""
        return sum(len(entry.req.pages) for entry in self.retired)

    @property
    def held_bytes(self) -> int:
        """Bytes of the held and retired requests' pages (``page_bytes`` per page)."""
        return self.ledger.held_bytes

    def next_deadline(self) -> float | None:
        """The earliest deadline of a held request, or ``None`` if none waits for one."""
        return min((entry.deadline for entry in self.held), default=None)

    # -- decisions -----------------------------------------------------------------------------

    def add(self, req: DecodeRequest) -> None:
        """Queue ``req``; its KV transfer is in progress."""
        self.queue.append(req)

    def pop_transferred(
        self,
        polls: Mapping[str, KVPoll],
        rids_to_check: Collection[str] | None = None,
    ) -> list[DecodeRequest]:
        """Take every request whose KV is committed out of the queue, in one pass.

        Only requests whose ``rid`` is in ``rids_to_check`` are examined (all when ``None``);
        a request missing from ``polls`` counts as still in progress. The survivors keep
        their order.

        - ``Failed``: ``kv.abort``; then, if the prefill ranks were told
          (``abort_notified``), the request is held (its pages and slot kept) until
          :meth:`resolve_deferred_releases` finds it drained or expired; otherwise
          ``kv.release`` and its slot is freed now.
        - ``Success``: ``kv.commit``. ``COMMITTED``: returned, and its slot freed unless the
          commit found a draft state (``req.draft``), whose slot stays held until the first
          decode step consumed it (:meth:`free_metadata`). ``NOT_READY``: stays queued with
          its slot. ``CORRUPT``: ``kv.abort``, ``kv.release``, slot freed.
        - Anything else: stays queued.

        A sink call that raises is logged and treated as the safest outcome (a raising
        ``commit`` counts as ``CORRUPT``); the pass goes on.

        :return: the committed requests, in queue order.
        """
        checked = _as_set(rids_to_check)
        queue = self.queue
        survivors: list[DecodeRequest] = []
        transferred: list[DecodeRequest] = []
        done = 0
        try:
            for req in queue:
                done += 1
                if checked is not None and req.rid not in checked:
                    survivors.append(req)
                    continue
                poll = polls.get(req.rid)
                if poll == KVPoll.Failed:
                    self._abort(req, f"KV transfer of request {req.rid!r} failed")
                    if req.abort_notified:
                        self._hold(req)
                    else:
                        self._release(req)
                elif poll == KVPoll.Success:
                    status = self._commit(req)
                    if status is CommitStatus.COMMITTED:
                        if req.draft is None:
                            self.free_metadata(req)
                        transferred.append(req)
                    elif status is CommitStatus.NOT_READY:
                        survivors.append(req)
                    else:
                        self._abort(
                            req,
                            f"KV metadata of request {req.rid!r} (room {req.room}) is not its "
                            "own: corrupt or a slot collision",
                        )
                        self._release(req)
                else:
                    survivors.append(req)
        finally:
            # Keep the queue consistent even if an invariant check raised mid-pass: what was
            # decided stays decided, what was not reached stays queued in order.
            survivors.extend(queue[done:])
            self.queue = survivors
        return transferred

    def resolve_deferred_releases(self) -> list[DecodeRequest]:
        """Release every held request that is drained, or past its deadline under ``REUSE``.

        A held request is released once ``required_acks`` distinct ranks acked its
        generation; past its deadline (``release_timeout_s`` after it was held) without
        them, ``on_timeout`` decides: ``REUSE`` releases it (logged as a warning: the pages
        are reused although a write might still land), ``RETIRE`` retires it (logged once
        as an error; see :meth:`resolve_deferred`, which also reports the retired).
        Releasing calls ``kv.release``, zeroes and frees the metadata slot, and clears the
        room's acks. A ``kv.release`` that raises is logged and its entry dropped, never
        retried (the pages may be half freed; freeing again could free someone else's); the
        others still resolve. Not a checkpoint.

        :return: the requests released without error, in the order they were held.
        """
        return list(self.resolve_deferred().released)

    def resolve_deferred(self) -> DeferredResolution:
        """:meth:`resolve_deferred_releases`, reporting what became of each entry it
        resolved: released drained, released at its deadline, retired, or failed to
        release. A retired entry is reported once, when it is retired; a later complete
        set of acks for its generation releases it (reported as drained), and nothing else
        does. Not a checkpoint."""
        if not self._entries:
            return _NOTHING_RESOLVED
        now = self._clock()
        due: list[tuple[HeldRelease, bool]] = []
        keep: list[HeldRelease] = []
        retiring: list[HeldRelease] = []
        for entry in self._entries:
            drained = self.acks.is_release_safe(
                entry.req.room, entry.required_acks, generation=entry.generation
            )
            if drained:
                due.append((entry, True))
            elif entry.retired_at is not None or now < entry.deadline:
                keep.append(entry)
            elif self.on_timeout is HoldPolicy.RETIRE:
                retired = dataclasses.replace(entry, retired_at=now)
                keep.append(retired)
                retiring.append(retired)
            else:
                due.append((entry, False))
        # Commit the survivors before releasing anything: whatever a release does, no
        # entry can be released twice.
        self._entries = keep
        for entry in retiring:
            log_retired(entry, self._acked(entry), now)
        drained_reqs: list[DecodeRequest] = []
        timed_out: list[DecodeRequest] = []
        released: list[DecodeRequest] = []
        failed: list[DecodeRequest] = []
        for entry, drained in due:
            if drained:
                entry.hold.settle(
                    f"{entry.required_acks} prefill ranks acked the drain of generation "
                    f"{entry.generation}"
                )
            else:
                log_reused(entry, self._acked(entry), now)
                entry.hold.settle(
                    "its release timeout ran out: given back to use by policy "
                    "(on_timeout=reuse), a late write may still land"
                )
            if self._release(entry.req):
                (drained_reqs if drained else timed_out).append(entry.req)
                released.append(entry.req)
            else:
                failed.append(entry.req)
        return DeferredResolution(
            drained=tuple(drained_reqs),
            timed_out=tuple(timed_out),
            retired=tuple(entry.req for entry in retiring),
            failed=tuple(failed),
            released=tuple(released),
        )

    def free_metadata(self, req: DecodeRequest) -> bool:
        """Zero and free the metadata slot ``req`` still holds, and drop its draft state.

        Idempotent: a request without a slot is left alone, so freeing twice is a no-op.

        :return: whether a slot was freed now.
        """
        req.draft = None
        slot = req.metadata_slot
        # A negative index means "no slot", the way some callers spell it.
        if slot is None or slot < 0:
            return False
        # Forget the slot first: whatever happens below, this request never frees it again
        # (once freed, the index may belong to someone else).
        req.metadata_slot = None
        try:
            self.slots.free(slot)
        except InternalError:
            raise
        except Exception:
            _log.exception(
                "zeroing metadata slot %d of request %r failed; the slot is leaked, not reused",
                slot,
                req.rid,
            )
        return True

    # -- helpers -------------------------------------------------------------------------------

    def _hold(self, req: DecodeRequest) -> None:
        generation = req.generation
        if generation is None:
            generation = self._adopt_or_arm(req.room)
            req.generation = generation
        now = self._clock()
        hold = Hold(
            f"{len(req.pages)} KV pages and metadata slot {req.metadata_slot} of request "
            f"{req.rid!r} (room {req.room}, abort generation {generation})",
            len(req.pages) * self.page_bytes,
        )
        self._entries.append(
            HeldRelease(
                req=req,
                generation=generation,
                required_acks=req.required_acks,
                held_at=now,
                deadline=now + self.release_timeout_s,
                hold=hold,
            )
        )
        self.ledger.add(hold)
        try:
            self.kv.hold(req, hold)
        except Exception:
            # The entry stays held and counted here whatever the sink did with the news.
            _log.exception("telling the KV sink that request %r is held raised", req.rid)

    def _acked(self, entry: HeldRelease) -> int:
        """How many ranks acked the entry's generation so far."""
        room = entry.req.room
        if self.acks.generation(room) != entry.generation:
            return 0
        return len(self.acks.acked_ranks(room))

    def _adopt_or_arm(self, room: int) -> int:
        current = self.acks.generation(room)
        # Retired entries own their generation too: their acks may still come.
        if current is not None and not any(
            entry.req.room == room and entry.generation == current for entry in self._entries
        ):
            return current
        _log.warning(
            "room %d was not armed before its abort was sent; acks sent so far are lost", room
        )
        return self.acks.arm(room)

    def _commit(self, req: DecodeRequest) -> CommitStatus:
        try:
            return self.kv.commit(req)
        except Exception:
            _log.exception("committing KV of request %r raised; aborting it", req.rid)
            return CommitStatus.CORRUPT

    def _abort(self, req: DecodeRequest, message: str) -> None:
        try:
            self.kv.abort(req, message)
        except Exception:
            _log.exception("aborting request %r raised", req.rid)

    def _release(self, req: DecodeRequest) -> bool:
        """Release pages, slot and ack state of ``req``; False if ``kv.release`` raised."""
        ok = True
        try:
            self.kv.release(req)
        except Exception:
            ok = False
            self.release_failures += 1
            _log.exception("releasing KV of request %r raised; not retried", req.rid)
        self.free_metadata(req)
        if req.generation is not None:
            self.acks.clear(req.room, generation=req.generation)
        return ok


def _as_set(rids: Collection[str] | None) -> Collection[str] | None:
    if rids is None or isinstance(rids, (set, frozenset)):
        return rids
    # A list would make every membership test a scan.
    return frozenset(rids)
