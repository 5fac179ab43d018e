"""The Mooncake landing pool: registered memory encoders write embeddings into.

One flat buffer, registered once with the receiver's transfer engine (a
:class:`~encdisagg.transfer.MemoryRegistration`), carved into pages. A part takes a run of
consecutive pages (one write per part). A run goes back to the free list once its write is
known to be over. A run whose write may still land is *held* (a
:class:`~encdisagg.transfer.Hold` on the registration): it is never handed out, and the
buffer is neither deregistered nor freed, until proof comes that the write ended; what
happens when the owner's bound runs out first is its policy (:meth:`LandingPool.retire` or
:meth:`LandingPool.reuse`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import torch

from .._errors import InternalError
from .._numbers import whole
from ..transfer import HeldLedger, Hold, MemoryRegistration

if TYPE_CHECKING:
    from ..transfer import TransferEngine

__all__ = ["LandingPool", "PageRun"]

_log = logging.getLogger("encdisagg.receiver")


@dataclass(frozen=True, slots=True)
class PageRun:
    """Consecutive pages ``[start, start + count)`` of a :class:`LandingPool`."""

    start: int
    count: int


class LandingPool:
    """Pages of one flat, registered buffer, handed out as runs of consecutive pages.

    :param num_pages: how many pages.
    :param page_bytes: bytes per page.

    Allocation, freeing and holding are synchronous and never checkpoint; a caller that
    found no run waits for pages to come back with :meth:`wait_freed`. Register the
    buffer for its working life with ``async with pool.registered(engine):``; keep every
    run's user inside that block.

    A page is in exactly one state: free, in a live run, *quarantined* (held, waiting for
    proof that a write into it ended) or *retired* (held past its owner's bound: out of use
    until proof comes, or for good).
    """

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        whole("num_pages", num_pages, least=1)
        whole("page_bytes", page_bytes, least=1)
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.buffer = torch.zeros(num_pages * page_bytes, dtype=torch.uint8)
        # 1 = free. Invariant: a page is free, in one live run, quarantined or retired.
        self._free = bytearray(b"\x01" * num_pages)
        self._available = num_pages
        self._live: set[PageRun] = set()
        self._quarantined: dict[PageRun, Hold] = {}
        self._retired: dict[PageRun, Hold] = {}
        #: Every hold taken on the buffer, those of runs reused past the bound included.
        self.ledger = HeldLedger("landing pool")
        self._registration: MemoryRegistration | None = None
        # Made by the first waiter (a pool may be built outside an event loop); set and
        # dropped when pages go back to the free list.
        self._freed: anyio.Event | None = None

    # -- allocation: synchronous -------------------------------------------------------------

    def pages_for(self, nbytes: int) -> int:
        """How many pages ``nbytes`` bytes take (at least one)."""
        return max(1, -(-nbytes // self.page_bytes))

    def available(self) -> int:
        """Free pages (held ones are not)."""
        return self._available

    @property
    def live_runs(self) -> int:
        return len(self._live)

    @property
    def quarantined_pages(self) -> int:
        """Pages held while their owner waits for proof that a write into them ended."""
        return sum(run.count for run in self._quarantined)

    @property
    def retired_pages(self) -> int:
        """Pages held past their owner's bound: out of use until proof comes, or for good."""
        return sum(run.count for run in self._retired)

    @property
    def held_pages(self) -> int:
        """Pages out of use because a write may still land in them (quarantined + retired)."""
        return self.quarantined_pages + self.retired_pages

    @property
    def held_bytes(self) -> int:
        """Bytes a write may still land in, pages reused past the bound included."""
        return self.ledger.held_bytes

    def held_runs(self) -> tuple[PageRun, ...]:
        """The runs out of use because a write may still land in them, by first page."""
        return tuple(sorted((*self._quarantined, *self._retired), key=lambda run: run.start))

    def alloc(self, count: int) -> PageRun | None:
        """The first free run of ``count`` consecutive pages, or ``None`` (taking nothing)."""
        if count < 1 or count > self.num_pages:
            raise ValueError(f"count must be in [1, {self.num_pages}], got {count}")
        if count > self._available:
            return None
        found = self._free.find(b"\x01" * count)
        if found < 0:
            return None
        run = PageRun(found, count)
        self._free[found : found + count] = b"\x00" * count
        self._available -= count
        self._live.add(run)
        return run

    def free(self, run: PageRun) -> None:
        """Give ``run`` back.

        :raises InternalError: if ``run`` is not a live run of this pool (a double free).
        """
        if run not in self._live:
            raise InternalError(f"landing pages {run.start}+{run.count} freed twice or never taken")
        self._live.remove(run)
        self._release(run)

    def hold(self, run: PageRun, hold: Hold) -> None:
        """Keep ``run`` out of use under ``hold``: a write may still land in it.

        The hold is counted in :attr:`ledger` and put on the buffer's registration, which is
        then neither deregistered nor freed before the hold settles.

        :raises InternalError: if ``run`` is not a live run of this pool.
        """
        if run not in self._live:
            raise InternalError(f"landing pages {run.start}+{run.count} are not live")
        self._live.remove(run)
        self._quarantined[run] = hold
        self.ledger.add(hold)
        registration = self._registration
        if registration is None:
            hold.keep(self.buffer)
        else:
            registration.hold(hold)

    def settle(self, run: PageRun, reason: str) -> None:
        """Proof came that no write lands in held ``run`` any more: settle its hold, free it.

        :raises InternalError: if ``run`` is not held.
        """
        hold = self._quarantined.pop(run, None)
        if hold is None:
            hold = self._retired.pop(run, None)
        if hold is None:
            raise InternalError(f"landing pages {run.start}+{run.count} are not held")
        hold.settle(reason)
        self._release(run)

    def retire(self, run: PageRun) -> None:
        """Its owner's bound ran out without proof: keep quarantined ``run`` out of use for
        good (until :meth:`settle`). Logged once, as an error.

        :raises InternalError: if ``run`` is not quarantined.
        """
        hold = self._quarantined.pop(run, None)
        if hold is None:
            raise InternalError(f"landing pages {run.start}+{run.count} are not quarantined")
        self._retired[run] = hold
        _log.error(
            "landing pages %d+%d are retired for good: their encoder never confirmed that its "
            "write into them ended (%d pages retired in all)",
            run.start,
            run.count,
            self.retired_pages,
        )

    def reuse(self, run: PageRun) -> None:
        """Its owner's bound ran out without proof: give quarantined ``run`` back to use.

        Its hold stays on the buffer (a write may still land in it, now in another
        request's part), so the buffer is still neither deregistered nor freed before proof
        comes. Logged once, as a warning.

        :raises InternalError: if ``run`` is not quarantined.
        """
        if self._quarantined.pop(run, None) is None:
            raise InternalError(f"landing pages {run.start}+{run.count} are not quarantined")
        _log.warning(
            "landing pages %d+%d reused after their quarantine: their encoder never confirmed "
            "that its write into them ended, and a late write would land in another request",
            run.start,
            run.count,
        )
        self._release(run)

    def _release(self, run: PageRun) -> None:
        self._free[run.start : run.start + run.count] = b"\x01" * run.count
        self._available += run.count
        if self._freed is not None:
            self._freed.set()
            self._freed = None

    async def wait_freed(self) -> None:
        """Wait until pages go back to the free list (freed, settled or reused). A
        checkpoint; not bounded: put it under a deadline."""
        if self._freed is None:
            self._freed = anyio.Event()
        await self._freed.wait()

    # -- addresses and views -----------------------------------------------------------------

    @property
    def ptr(self) -> int:
        return int(self.buffer.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def address(self, run: PageRun) -> int:
        """Where ``run`` starts, for a remote writer."""
        return self.ptr + run.start * self.page_bytes

    def view(self, run: PageRun, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes of ``run`` (a view: no copy)."""
        if nbytes > run.count * self.page_bytes:
            raise InternalError(f"{nbytes} bytes do not fit landing pages {run.start}+{run.count}")
        start = run.start * self.page_bytes
        return self.buffer[start : start + nbytes]

    # -- registration ------------------------------------------------------------------------

    @property
    def registration(self) -> MemoryRegistration | None:
        """The buffer's registration, once :meth:`registered` made it."""
        return self._registration

    @property
    def registered_with(self) -> TransferEngine | None:
        """The engine the buffer is registered with now (also when it was left to it)."""
        registration = self._registration
        return None if registration is None or not registration.registered else registration.engine

    @asynccontextmanager
    async def registered(
        self, engine: TransferEngine, *, close_timeout_s: float = 10.0
    ) -> AsyncIterator[LandingPool]:
        """Register the buffer with ``engine`` for the block.

        Registering is a checkpoint for a blocking engine, which runs in a worker thread
        that is never abandoned; a caller cancelled meanwhile leaves only once the engine
        returned, with a registration made recorded and dropped on the way out.

        Leaving is shielded. A buffer no run is held on is deregistered (bounded by
        ``close_timeout_s``; past it, or should the engine keep failing, it is left to the
        engine). A buffer still held is not waited for here — wait for the holds that may
        still settle before leaving — but left to the engine at once: neither deregistered
        nor freed, it is kept until the engine closes (logged).

        :raises InternalError: if the pool was registered before.
        :raises TransferError: the engine refused the registration.
        """
        if self._registration is not None:
            raise InternalError("the landing pool was registered before")
        registration = MemoryRegistration(
            engine,
            self.ptr,
            self.nbytes,
            self.buffer,
            what=f"the landing pool ({self.num_pages} x {self.page_bytes} B)",
        )
        self._registration = registration
        try:
            await registration.open()
            yield self
        finally:
            if registration.held:
                registration.leave(
                    f"{len(self.ledger)} of its page runs are held: a write may still land in them"
                )
                await anyio.lowlevel.cancel_shielded_checkpoint()
            else:
                await registration.close(timeout_s=close_timeout_s)
