"""A keyed rendezvous: wait, bounded, for a key to be published."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["KeyRemovedError", "KeyedRendezvous"]

K = TypeVar("K")
V = TypeVar("V")


class KeyRemovedError(LookupError):
    """The key a waiter waited for was removed before it was published."""


@dataclass(eq=False)
class _Wakeup:
    # One per key with waiters; replaced after every wake-up, so a waiter that arrives later
    # never sees a stale "removed" flag.
    event: anyio.Event = field(default_factory=anyio.Event)
    waiters: int = 0
    removed: bool = False


class KeyedRendezvous(Generic[K, V]):
    """Values published under keys, and tasks waiting for them.

    Publishing or removing a key wakes every task waiting on it. A waiter that times out or
    is cancelled leaves nothing behind: the table holds an entry for a key only while the key
    is published or while somebody is waiting on it.

    All methods except :meth:`wait` are synchronous and never checkpoint.
    """

    def __init__(self) -> None:
        self._values: dict[K, V] = {}
        self._wakeups: dict[K, _Wakeup] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: K) -> V | None:
        """The value published under ``key``, or ``None``."""
        return self._values.get(key)

    def keys(self) -> list[K]:
        """A snapshot of the published keys."""
        return list(self._values)

    def waiting(self, key: K) -> int:
        """How many tasks are waiting on ``key`` right now."""
        wakeup = self._wakeups.get(key)
        return 0 if wakeup is None else wakeup.waiters

    def publish(self, key: K, value: V) -> None:
        """Publish (or replace) ``value`` under ``key`` and wake every waiter on it."""
        self._values[key] = value
        self._wake(key, removed=False)

    def remove(self, key: K) -> V | None:
        """Remove ``key`` (if published) and wake its waiters; they raise ``KeyRemovedError``.

        Returns the value that was published, or ``None``.
        """
        value = self._values.pop(key, None)
        self._wake(key, removed=True)
        return value

    def _wake(self, key: K, *, removed: bool) -> None:
        wakeup = self._wakeups.pop(key, None)
        if wakeup is not None:
            wakeup.removed = removed
            wakeup.event.set()

    async def wait(self, key: K) -> V:
        """Wait until ``key`` is published and return its value.

        This is a checkpoint, also when the key is already published. Bound it with
        ``anyio.fail_after``: a wait that times out or is cancelled leaves no trace.

        :raises KeyRemovedError: if ``remove(key)`` was called while waiting.
        """
        await anyio.lowlevel.checkpoint()
        while key not in self._values:
            wakeup = self._wakeups.get(key)
            if wakeup is None:
                wakeup = self._wakeups[key] = _Wakeup()
            wakeup.waiters += 1
            try:
                await wakeup.event.wait()
            finally:
                wakeup.waiters -= 1
                # Only the entry still in the table is ours to drop; a wake-up already
                # popped it.
                if wakeup.waiters == 0 and self._wakeups.get(key) is wakeup:
                    del self._wakeups[key]
            if wakeup.removed and key not in self._values:
                raise KeyRemovedError(key)
        return self._values[key]
