"""Tasks parked per key until synchronous code wakes that key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio

__all__ = ["KeyedWakeups"]

K = TypeVar("K")


@dataclass(eq=False)
class _Wakeup:
    # One per key with parked tasks; replaced after every wake-up, so a task that parks
    # later never sees a stale flag.
    event: anyio.Event = field(default_factory=anyio.Event)
    waiters: int = 0
    removed: bool = False


class KeyedWakeups(Generic[K]):
    """Parking places per key: :meth:`park` waits until :meth:`wake` is called for the key.

    The table holds an entry for a key only while some task is parked on it; a task that
    is woken, times out or is cancelled leaves nothing behind. Callers re-check their own
    condition after each wake-up (``while not ready(): await wakeups.park(key)``).
    """

    def __init__(self) -> None:
        self._wakeups: dict[K, _Wakeup] = {}

    def waiting(self, key: K) -> int:
        """How many tasks are parked on ``key`` right now. Not a checkpoint."""
        wakeup = self._wakeups.get(key)
        return 0 if wakeup is None else wakeup.waiters

    def wake(self, key: K, *, removed: bool = False) -> None:
        """Wake every task parked on ``key``; they see ``removed``. Not a checkpoint."""
        wakeup = self._wakeups.pop(key, None)
        if wakeup is not None:
            wakeup.removed = removed
            wakeup.event.set()

    async def park(self, key: K) -> bool:
        """Wait for the next :meth:`wake` of ``key`` and return its ``removed`` flag.

        A checkpoint. Cancellation leaves no trace of the wait.
        """
        wakeup = self._wakeups.get(key)
        if wakeup is None:
            wakeup = self._wakeups[key] = _Wakeup()
        wakeup.waiters += 1
        try:
            await wakeup.event.wait()
        finally:
            wakeup.waiters -= 1
            # Only the entry still in the table is ours to drop; a wake-up already popped it.
            if wakeup.waiters == 0 and self._wakeups.get(key) is wakeup:
                del self._wakeups[key]
        return wakeup.removed
