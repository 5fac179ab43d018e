"""What an engine's destruction must wait for, and what it lets go; memory left to it.

An engine that cannot call its writes back must outlive every write made through it, and
its destruction is the last proof that nothing touches memory through it any more. An
:class:`EngineLifetime` keeps that account for one engine: the writes in flight (the engine
is destroyed only once none is left), the holds on writes whose outcome is unknown (with
their local ranges, which stay registered), and what owners left to the engine
(:meth:`keep`). :meth:`destroyed` settles the holds and drops what was kept.

When an owner closes while memory it registered is still held (a transfer may still touch
it), the owner can neither deregister nor free that memory, and it cannot wait for ever. It
leaves the memory to the engine (:func:`leave_with_engine`): an engine that says when it is
destroyed (one with ``keep_until_closed``, as :class:`MooncakeEngine` and
:class:`LoopbackEngine` have) keeps it until then, since nothing touches memory through a
destroyed engine. For an engine that cannot say, the memory is kept for the life of the
process: leaking it is the only choice that cannot corrupt another request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol, final, runtime_checkable

import anyio
import anyio.to_thread

from ._holds import Hold

__all__ = ["EngineLifetime", "KeepsMemory", "close_in_thread", "leave_with_engine"]

_log = logging.getLogger("encdisagg.transfer")


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


@runtime_checkable
class KeepsMemory(Protocol):
    """An engine that keeps memory alive until it was destroyed (an optional capability of
    a :class:`~encdisagg.transfer.TransferEngine`)."""

    def keep_until_closed(self, keepalive: object, ptr: int | None = None) -> None:
        """Reference ``keepalive`` until the engine was destroyed (at once dropped if it was
        already); the region registered at ``ptr``, if given, is left registered until then.
        Thread-safe; never blocks for long."""
        ...


#: What engines that cannot say when they are destroyed were left: a lifetime that never ends.
_FOR_GOOD = EngineLifetime()


def leave_with_engine(
    engine: object, keepalive: object, *, what: str, ptr: int | None = None
) -> None:
    """Keep ``keepalive`` (what owns ``what``) alive as long as ``engine`` may touch it.

    Not a checkpoint; thread-safe. Logged as an error: memory left this way is out of use
    until the engine closes, or for good.
    """
    if isinstance(engine, KeepsMemory):
        _log.error(
            "%s is left to its transfer engine %r: a transfer may still touch it, so it is "
            "kept until the engine closes",
            what,
            engine,
        )
        engine.keep_until_closed(keepalive, ptr)
        return
    _log.error(
        "%s is kept for the life of the process: a transfer may still touch it, and its "
        "engine %r cannot say when it stops",
        what,
        engine,
    )
    _FOR_GOOD.keep(keepalive)


async def close_in_thread(close: Callable[[], object], timeout_s: float) -> bool:
    """Call ``close`` in a worker thread, shielded, for at most ``timeout_s``: whether it
    returned in time. Past the bound the thread is left running: only for a close that
    frees nothing a transfer may still touch before it ends. A checkpoint."""
    with anyio.move_on_after(timeout_s, shield=True):
        await anyio.to_thread.run_sync(close, abandon_on_cancel=True)
        return True
    return False
