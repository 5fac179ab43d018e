"""An event that any thread may set without blocking, awaited on the event loop.

``anyio.Event.set`` is not thread-safe, and ``anyio.from_thread.run_sync`` blocks the
calling thread until the loop ran the call: from a thread that must never wait on the loop
(a library's own completion thread, a finalizer) neither will do. :class:`ThreadSafeEvent`
hands ``set`` to the loop with the backend's own non-blocking entry (asyncio's
``call_soon_threadsafe``, Trio's ``TrioToken.run_sync_soon``), so the setting thread never
waits, and a loop that is gone already is ignored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import final

import anyio
import sniffio

__all__ = ["ThreadSafeEvent"]


@final
class ThreadSafeEvent:
    """A one-shot event: :meth:`set_from_thread` from any thread, :meth:`wait` on the loop.

    Create it on the event loop (it remembers that loop). Setting it twice is harmless.
    """

    __slots__ = ("_event", "_schedule")

    def __init__(self, schedule: Callable[[Callable[[], object]], object] | None = None) -> None:
        """:param schedule: the loop's thread-safe call-soon, as :meth:`loop_scheduler`
        gave it on this loop (looked up here when not given)."""
        self._event = anyio.Event()
        self._schedule = self.loop_scheduler() if schedule is None else schedule

    @staticmethod
    def loop_scheduler() -> Callable[[Callable[[], object]], object]:
        """The running loop's thread-safe, non-blocking call-soon: to look up once and pass
        to many events of this loop. Call it on the loop."""
        if sniffio.current_async_library() == "trio":
            import trio

            return trio.lowlevel.current_trio_token().run_sync_soon
        import asyncio

        return asyncio.get_running_loop().call_soon_threadsafe

    def set_from_thread(self) -> None:
        """Set the event soon, from any thread (the loop's own included). Never blocks.

        Does nothing once the event loop finished.
        """
        # RuntimeError: asyncio's loop is closed; trio.RunFinishedError (a RuntimeError)
        # likewise for Trio. Nobody can be waiting any more then.
        with contextlib.suppress(RuntimeError):
            self._schedule(self._event.set)

    def is_set(self) -> bool:
        """Whether the loop has set it. Not a checkpoint."""
        return self._event.is_set()

    async def wait(self) -> None:
        """Return once set. A checkpoint; cancelling the wait leaves the event as it was."""
        await self._event.wait()
