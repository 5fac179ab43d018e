"""The transfer engine protocol: how staged memory reaches a remote buffer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["EngineOptions", "TransferEngine"]


@runtime_checkable
class TransferEngine(Protocol):
    """Moves bytes from local registered memory into a peer's registered memory.

    Calls may block; the Encoder makes them from worker threads that are never abandoned,
    unless the engine has a class attribute ``blocking = False`` (its calls finish in
    microseconds without waiting on a peer, like :class:`LoopbackEngine`'s), in which case
    they are made inline on the event loop. Failures raise :class:`~encdisagg.TransferError`
    naming the call (and the engine's return code where it has one).

    What an engine must guarantee:

    - ``register`` either registers the whole range or raises having registered nothing;
      ``deregister`` either drops the registration or raises having kept it (then the same
      ``deregister`` may be called again later);
    - ``write`` returns (or raises) only once it stopped reading local memory, with one
      exception: an engine that gives up waiting for a write it cannot call back raises
      :class:`~encdisagg.TransferTimeoutError` whose ``hold`` (a
      :class:`~encdisagg.transfer.Hold`) it settles once the write is known to have ended,
      or once the engine itself was destroyed. The memory stays held (never freed, reused
      or deregistered) until then; a ``TransferTimeoutError`` without a hold keeps it for
      good;
    - calls are thread-safe: the Encoder may make several at once, from several threads.

    An engine may also keep memory for its owners until it was destroyed
    (``keep_until_closed``, see :class:`~encdisagg.transfer.KeepsMemory`): an owner that
    closes while its memory is held leaves it there instead of keeping it for good.

    It need not detect overlapping registrations, double deregistrations or writes from
    unregistered memory (a NIC would not); the Encoder never asks for them:

    - a pointer is never registered twice at once (the staging arena is registered once; a
      request's own region once; per-send registrations of one request are serialised);
    - ``deregister`` is called only after every ``write`` from that memory returned, never
      twice for one successful registration, and never concurrently for one region;
    - memory stays allocated (and counted as staged) until its ``deregister`` returned,
      also when that takes longer than the Encoder's cleanup bound.
    """

    @property
    def session_id(self) -> str:
        """How peers address this engine (``"host:port"`` for Mooncake)."""
        ...

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` of local memory at ``ptr`` for transfers."""
        ...

    def deregister(self, ptr: int) -> None:
        """Deregister the region registered at ``ptr``."""
        ...

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        """Copy ``nbytes`` from local ``local_ptr`` to ``remote_ptr`` in ``target_session``."""
        ...


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """The optional members of a :class:`TransferEngine`, each with the default an engine that
    does not declare it gets; :meth:`of` is the one place their presence is asked.

    (``keep_until_closed`` is :class:`~encdisagg.transfer.KeepsMemory`, a protocol of its own.)
    """

    #: ``False``: every call finishes in microseconds without waiting on a peer (like
    #: :class:`LoopbackEngine`'s), so callers make them inline on the event loop.
    blocking: bool = True
    #: ``write_async(target_session, local_ptr, remote_ptr, nbytes)``: :meth:`write`
    #: awaited on the event loop instead of in a worker thread (:class:`MooncakeEngine`).
    write_async: Callable[..., Awaitable[None]] | None = None

    @classmethod
    def of(cls, engine: object) -> EngineOptions:
        """What ``engine`` declares, defaults for the rest. Not async."""
        write_async = getattr(engine, "write_async", None)
        return cls(
            blocking=bool(getattr(engine, "blocking", True)),
            write_async=write_async if callable(write_async) else None,
        )
