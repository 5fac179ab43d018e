"""The Mooncake landing pool: registered memory encoders write embeddings into.

One flat buffer, registered once with the receiver's transfer engine, carved into pages. A
part takes a run of consecutive pages (one write per part). A run goes back to the free list
once its write is known to be over; a run whose write may still be in flight is quarantined
until a deadline instead.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import torch

from .._errors import InternalError
from ..nurseries import run_thread_to_completion

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

    Allocation, freeing and quarantine are synchronous and never checkpoint. Register the
    buffer for its working life with ``async with pool.registered(engine):``; keep every
    run's user inside that block.
    """

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes < 1:
            raise ValueError(f"page_bytes must be a positive integer, got {page_bytes!r}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.buffer = torch.zeros(num_pages * page_bytes, dtype=torch.uint8)
        # 1 = free. Invariant: a page is in exactly one of: free, some live run, quarantine.
        self._free = bytearray(b"\x01" * num_pages)
        self._available = num_pages
        self._live: set[PageRun] = set()
        # Runs whose write may still land, with the clock reading after which they return.
        self._quarantine: dict[PageRun, float] = {}
        self._engine: TransferEngine | None = None

    # -- allocation: synchronous -------------------------------------------------------------

    def pages_for(self, nbytes: int) -> int:
        """How many pages ``nbytes`` bytes take (at least one)."""
        return max(1, -(-nbytes // self.page_bytes))

    def available(self) -> int:
        """Free pages (not counting quarantined ones)."""
        return self._available

    @property
    def live_runs(self) -> int:
        return len(self._live)

    @property
    def quarantined_pages(self) -> int:
        return sum(run.count for run in self._quarantine)

    def alloc(self, count: int, *, now: float | None = None) -> PageRun | None:
        """The first free run of ``count`` consecutive pages, or ``None`` (taking nothing).

        With ``now``, quarantined runs whose deadline passed are freed first.
        """
        if count < 1 or count > self.num_pages:
            raise ValueError(f"count must be in [1, {self.num_pages}], got {count}")
        if now is not None:
            self.reclaim(now)
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

    def quarantine(self, run: PageRun, until: float) -> None:
        """Hold ``run`` back until the clock reads ``until``: a write may still land in it."""
        if run not in self._live:
            raise InternalError(f"landing pages {run.start}+{run.count} are not live")
        self._live.remove(run)
        self._quarantine[run] = until

    def reclaim(self, now: float) -> int:
        """Free the quarantined runs whose deadline passed; returns how many pages."""
        due = [run for run, until in self._quarantine.items() if until <= now]
        for run in due:
            del self._quarantine[run]
            _log.warning(
                "landing pages %d+%d reused after their quarantine: an encoder never confirmed "
                "its write into them stopped",
                run.start,
                run.count,
            )
            self._release(run)
        return sum(run.count for run in due)

    def next_reclaim(self) -> float | None:
        """When the next quarantined run comes back, or ``None``."""
        return min(self._quarantine.values(), default=None)

    def _release(self, run: PageRun) -> None:
        self._free[run.start : run.start + run.count] = b"\x01" * run.count
        self._available += run.count

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
    def registered_with(self) -> TransferEngine | None:
        return self._engine

    @asynccontextmanager
    async def registered(self, engine: TransferEngine) -> AsyncIterator[LandingPool]:
        """Register the buffer with ``engine`` for the block.

        Registering runs in a worker thread that is never abandoned (a checkpoint).
        Deregistering on exit is shielded and waits for the engine: giving up on it would
        leave the engine pointing at memory about to be freed.

        :raises InternalError: if the pool is registered already.
        """
        if self._engine is not None:
            raise InternalError("the landing pool is registered already")
        await run_thread_to_completion(engine.register, self.ptr, self.nbytes)
        self._engine = engine
        try:
            yield self
        finally:
            self._engine = None
            with anyio.CancelScope(shield=True):
                await run_thread_to_completion(engine.deregister, self.ptr)
