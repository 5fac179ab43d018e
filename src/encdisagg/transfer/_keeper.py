"""Memory left to its engine: kept alive for as long as that engine may still touch it.

When an owner closes while memory it registered is still held (a transfer may still touch
it), the owner can neither deregister nor free that memory, and it cannot wait for ever. It
leaves the memory to the engine: an engine that says when it is destroyed (one with
``keep_until_closed``, as :class:`MooncakeEngine` and :class:`LoopbackEngine` have) keeps it
until then, since nothing touches memory through a destroyed engine. For an engine that
cannot say, the memory is kept for the life of the process: leaking it is the only choice
that cannot corrupt another request.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol, runtime_checkable

__all__ = ["KeepsMemory", "leave_with_engine"]

_log = logging.getLogger("encdisagg.transfer")


@runtime_checkable
class KeepsMemory(Protocol):
    """An engine that keeps memory alive until it was destroyed (an optional capability of
    a :class:`~encdisagg.transfer.TransferEngine`)."""

    def keep_until_closed(self, keepalive: object, ptr: int | None = None) -> None:
        """Reference ``keepalive`` until the engine was destroyed (at once dropped if it was
        already); the region registered at ``ptr``, if given, is left registered until then.
        Thread-safe; never blocks for long."""
        ...


class _KeptForGood:
    """What engines that cannot say when they are destroyed were left: never freed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[object] = []

    def add(self, keepalive: object) -> None:
        with self._lock:
            self._kept.append(keepalive)


_FOR_GOOD = _KeptForGood()


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
    _FOR_GOOD.add(keepalive)
