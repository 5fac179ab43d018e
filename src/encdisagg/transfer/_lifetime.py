"""What an engine's destruction must wait for, and what it lets go.

An engine that cannot call its writes back must outlive every write made through it, and
its destruction is the last proof that nothing touches memory through it any more. An
:class:`EngineLifetime` keeps that account for one engine: the writes in flight (the engine
is destroyed only once none is left), the holds on writes whose outcome is unknown (with
their local ranges, which stay registered), and what owners left to the engine
(:meth:`keep`). :meth:`destroyed` settles the holds and drops what was kept.
"""

from __future__ import annotations

import threading
from typing import final

from ._holds import Hold

__all__ = ["EngineLifetime"]


@final
class EngineLifetime:
    """The account of one engine's writes and held memory. Thread-safe; nothing awaits."""

    __slots__ = ("_condition", "_destroyed", "_kept", "_unsettled", "_writing")

    def __init__(self) -> None:
        self._condition = threading.Condition()
        # Guarded by _condition.
        self._writing = 0
        self._unsettled: dict[Hold, tuple[int, int]] = {}
        self._kept: list[tuple[object, int | None]] = []
        self._destroyed = False

    # -- writes -----------------------------------------------------------------------------

    def begin_write(self) -> None:
        """A write starts (the engine checked it may)."""
        with self._condition:
            self._writing += 1

    def end_write(self) -> None:
        """A write ended, or outlived its bound (then :meth:`hold` it first)."""
        with self._condition:
            self._writing -= 1
            if not self._writing:
                self._condition.notify_all()

    def wait_writes_ended(self) -> None:
        """Block until no write is in flight. Each is bounded by its engine's own bound."""
        with self._condition:
            self._condition.wait_for(lambda: self._writing == 0)

    def hold(self, what: str, local_ptr: int, nbytes: int) -> Hold:
        """A hold on the local memory of a write whose outcome is unknown; tracked until it
        settles, and settled by :meth:`destroyed` at the latest."""
        hold = Hold(what, nbytes)
        with self._condition:
            self._unsettled[hold] = (local_ptr, nbytes)
        hold.on_settled(self._forget)
        return hold

    def _forget(self, hold: Hold) -> None:
        with self._condition:
            self._unsettled.pop(hold, None)

    @property
    def unsettled(self) -> int:
        """Writes whose outcome is still unknown."""
        with self._condition:
            return len(self._unsettled)

    # -- memory left to the engine ------------------------------------------------------------

    def keep(self, keepalive: object, ptr: int | None = None) -> None:
        """Reference ``keepalive`` until :meth:`destroyed` (dropped at once after it)."""
        with self._condition:
            if not self._destroyed:
                self._kept.append((keepalive, ptr))

    def spares(self, ptr: int, nbytes: int) -> bool:
        """Whether the region at ``ptr`` must stay registered until the engine is destroyed:
        it was left to the engine, or a held write reads from it."""
        with self._condition:
            if any(kept_ptr == ptr for _, kept_ptr in self._kept):
                return True
            return any(
                start < ptr + nbytes and ptr < start + size
                for start, size in self._unsettled.values()
            )

    def destroyed(self, reason: str) -> None:
        """The engine is gone: settle every hold, then drop what was kept."""
        with self._condition:
            self._destroyed = True
            unsettled = list(self._unsettled)
            left, self._kept = self._kept, []
        for hold in unsettled:
            hold.settle(reason)
        del left
