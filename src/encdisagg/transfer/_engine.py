"""The transfer engine protocol: how staged memory reaches a remote buffer."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["TransferEngine"]


@runtime_checkable
class TransferEngine(Protocol):
    """Moves bytes from local registered memory into a peer's registered memory.

    Every call blocks; the Encoder calls them from worker threads, never on the event loop.
    Failures raise :class:`~encdisagg.TransferError` naming the call (and the engine's return
    code where it has one).
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
