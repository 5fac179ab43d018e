"""A keyed rendezvous: wait, bounded, for a key to be published."""

from __future__ import annotations

from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

from ._wakeups import KeyedWakeups

__all__ = ["KeyRemovedError", "KeyedRendezvous"]

K = TypeVar("K")
V = TypeVar("V")


class KeyRemovedError(LookupError):
    """The key a waiter waited for was removed before it was published."""


class KeyedRendezvous(KeyedWakeups[K], Generic[K, V]):
    """Values published under keys, and tasks waiting for them.

    Publishing or removing a key wakes every task waiting on it. A waiter that times out or
    is cancelled leaves nothing behind: the table holds an entry for a key only while the key
    is published or while somebody is waiting on it.

    All methods except :meth:`wait` are synchronous and never checkpoint.
    """

    def __init__(self) -> None:
        super().__init__()
        self._values: dict[K, V] = {}

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

    def publish(self, key: K, value: V) -> None:
        """Publish (or replace) ``value`` under ``key`` and wake every waiter on it."""
        self._values[key] = value
        self.wake(key)

    def remove(self, key: K) -> V | None:
        """Remove ``key`` (if published) and wake its waiters; they raise ``KeyRemovedError``.

        Returns the value that was published, or ``None``.
        """
        value = self._values.pop(key, None)
        self.wake(key, removed=True)
        return value

    async def wait(self, key: K) -> V:
        """Wait until ``key`` is published and return its value.

        This is a checkpoint, also when the key is already published. Bound it with
        ``anyio.fail_after``: a wait that times out or is cancelled leaves no trace.

        :raises KeyRemovedError: if ``remove(key)`` was called while waiting.
        """
        await anyio.lowlevel.checkpoint()
        while key not in self._values:
            removed = await self.park(key)
            if removed and key not in self._values:
                raise KeyRemovedError(key)
        return self._values[key]
