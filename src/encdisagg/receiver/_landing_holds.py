"""Landing pages a write may still land in, and who asks whether it ended.

A part whose encoder did not confirm that its write stopped (its ``/send`` did not return,
and its ``/release`` was answered "held" or not at all) keeps its landing run under a
:class:`~encdisagg.transfer.Hold` once its request ended. Only its encoder can prove the
write ended, by answering a release: a task asks it again (through a *recheck* the fetch
supplies, so the receiver knows nothing of HTTP) with backoff, 0.5 s doubling to 5 s apart,
and the answer that confirms settles the hold and frees the pages. The receiver's own bound
(``quarantine_s``) ends the asking; what happens to the pages then is its
:class:`~encdisagg.transfer.HoldPolicy`: retired for good (the default) or reused. A part
nobody can ask (its encoder is gone) just waits for the bound.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final

import anyio
import anyio.abc

from ..transfer import Hold, HoldPolicy

if TYPE_CHECKING:
    from ._landing import LandingPool, PageRun

__all__ = ["HeldLandings", "Recheck"]

_log = logging.getLogger("encdisagg.receiver")

#: Asks whether a part's write ended: True once its encoder confirmed that nothing of it can
#: land any more; False while it says the write may still land, or does not answer. Should
#: not raise: an exception counts as no answer (and is logged).
Recheck = Callable[[], Awaitable[bool]]

#: The first ask comes this long after the release that left the run held, the next ones
#: twice as long after each other, at most _MAX_ASK_S apart.
_FIRST_ASK_S: Final = 0.5
_MAX_ASK_S: Final = 5.0

_CONFIRMED: Final = "its encoder confirmed that no write into it can land any more"


class HeldLandings(anyio.AsyncContextManagerMixin):
    """The held runs of one landing pool, each watched by a task of its own.

    ``async with`` owns the tasks. Leaving waits (shielded, at most ``close_timeout_s``) for
    the runs whose encoder is still being asked, then stops watching: a run still held
    then stays held, and its pool is left to the engine.

    :param pool: the landing pool.
    :param bound_s: how long a held run is asked about before ``policy`` applies.
    :param policy: what happens to a run whose bound ran out without proof.
    :param close_timeout_s: the most leaving waits for asks in progress.
    """

    def __init__(
        self,
        pool: LandingPool,
        *,
        bound_s: float,
        policy: HoldPolicy,
        close_timeout_s: float,
    ) -> None:
        self._pool = pool
        self._bound_s = bound_s
        self._policy = policy
        self._close_timeout_s = close_timeout_s
        self._group: anyio.abc.TaskGroup | None = None
        # Runs whose encoder is being asked; _asked is set (and replaced) when one is done.
        self._asking = 0
        self._asked = anyio.Event()

    def hold(self, run: PageRun, part_id: str, recheck: Recheck | None) -> None:
        """Hold live ``run`` of part ``part_id``: a write may still land in it.

        With ``recheck``, it is asked (with backoff) until it confirms, which frees the
        run, or the bound runs out; without, the run waits for the bound. Not a checkpoint.
        While closing, nobody watches the run any more: it stays held.
        """
        nbytes = run.count * self._pool.page_bytes
        what = f"landing pages {run.start}+{run.count} of part {part_id!r} ({nbytes} bytes)"
        self._pool.hold(run, Hold(what, nbytes))
        group = self._group
        if group is None:
            return
        if recheck is not None:
            self._asking += 1
        deadline = anyio.current_time() + self._bound_s
        group.start_soon(self._watch, run, part_id, recheck, deadline, name=f"watch {what}")

    async def _watch(
        self, run: PageRun, part_id: str, recheck: Recheck | None, deadline: float
    ) -> None:
        try:
            with anyio.CancelScope(deadline=deadline):
                await _ask_until_confirmed(part_id, recheck)
                self._pool.settle(run, _CONFIRMED)
                return
            if self._policy is HoldPolicy.RETIRE:
                self._pool.retire(run)
            else:
                self._pool.reuse(run)
        finally:
            if recheck is not None:
                self._asking -= 1
                self._asked.set()
                self._asked = anyio.Event()

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[HeldLandings]:
        """Entering is not a checkpoint; leaving is shielded and bounded."""
        if self._group is not None:
            raise RuntimeError("HeldLandings is entered once")
        async with anyio.create_task_group() as group:
            self._group = group
            try:
                yield self
            finally:
                # A confirmation that comes now still frees its pages, and a pool without
                # holds is deregistered rather than left to the engine.
                with anyio.move_on_after(self._close_timeout_s, shield=True):
                    while self._asking:
                        await self._asked.wait()
                self._group = None
                group.cancel_scope.cancel("the landing pool closes")


async def _ask_until_confirmed(part_id: str, recheck: Recheck | None) -> None:
    """Return once ``recheck`` confirmed; never, without one. A checkpoint."""
    if recheck is None:
        await anyio.sleep_forever()
        return
    delay = _FIRST_ASK_S
    while True:
        await anyio.sleep(delay)
        try:
            if await recheck():
                return
        except Exception:
            _log.exception("asking whether part %r's write ended failed", part_id)
        delay = min(delay * 2, _MAX_ASK_S)
