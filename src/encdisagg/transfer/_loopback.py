"""An in-process transfer engine: engines on one fabric copy into each other's memory."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import final

import anyio

from .._errors import TransferError
from ._lifetime import EngineLifetime
from ._regions import RegionTable, check_range

__all__ = ["LoopbackEngine", "LoopbackFabric"]


@final
class LoopbackFabric:
    """The engines of one process that can write into each other's registered memory.

    A fabric is an explicit object, never a global: two fabrics (or two tests) never see
    each other's engines. One lock guards every engine's registrations and every copy, so a
    deregistration can never interleave with a write that reads or fills that region.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, LoopbackEngine] = {}
        self._created = 0

    def sessions(self) -> tuple[str, ...]:
        """The session ids of the engines on this fabric, in joining order."""
        with self._lock:
            return tuple(self._engines)

    def _join(self, engine: LoopbackEngine, name: str | None) -> str:
        with self._lock:
            self._created += 1
            session_id = f"loopback-{self._created}" if name is None else name
            if not isinstance(session_id, str) or not session_id:
                raise TransferError(f"loopback engine name must be a non-empty str; got {name!r}")
            if session_id in self._engines:
                raise TransferError(
                    f"loopback session {session_id!r} already exists on this fabric"
                )
            self._engines[session_id] = engine
            return session_id


@final
class LoopbackEngine(anyio.AsyncContextManagerMixin):
    """A :class:`~encdisagg.transfer.TransferEngine` that copies within one process.

    For single-process deployments and tests. Engines on the same :class:`LoopbackFabric`
    write into each other's registered regions by ``session_id``; an engine without a fabric
    gets a private one and can still write into its own regions through its own
    ``session_id``. All calls block briefly (a ``memmove`` at most) and are thread-safe.

    The engine works as soon as it is constructed; ``async with`` (or :meth:`close`) makes
    it leave its fabric and forget its registrations at the end.

    :param fabric: the fabric to join; a private one if omitted.
    :param name: the session id; ``"loopback-N"`` if omitted.
    :raises TransferError: if ``name`` is taken on the fabric.
    """

    #: Its calls are in-process copies that never wait on a peer: callers may make them
    #: inline, on the event loop.
    blocking = False

    def __init__(self, fabric: LoopbackFabric | None = None, *, name: str | None = None) -> None:
        self._fabric = LoopbackFabric() if fabric is None else fabric
        self._regions = RegionTable()  # guarded by the fabric's lock
        self._closed = False  # guarded by the fabric's lock
        self._lifetime = EngineLifetime()
        self._session_id = self._fabric._join(self, name)

    @property
    def session_id(self) -> str:
        """This engine's id on its fabric."""
        return self._session_id

    @property
    def fabric(self) -> LoopbackFabric:
        return self._fabric

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` at ``ptr`` as readable and writable by transfers.

        :raises TransferError: for ``nbytes <= 0``, a bad address, a range that overlaps (or
            repeats) a registered one, or a closed engine.
        """
        call = "loopback register"
        check_range(call, "ptr", ptr, nbytes)
        with self._fabric._lock:
            self._check_open(call)
            self._regions.refuse_overlap(call, ptr, nbytes, f" on {self._session_id}")
            self._regions.add(ptr, nbytes)

    def deregister(self, ptr: int) -> None:
        """Forget the region registered at ``ptr``.

        :raises TransferError: if no region starts at ``ptr`` (also when it was deregistered
            already), or the engine is closed.
        """
        call = "loopback deregister"
        with self._fabric._lock:
            self._check_open(call)
            self._regions.refuse_unknown(call, ptr, f" on {self._session_id}")
            self._regions.remove(ptr)

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``local_ptr`` here into ``remote_ptr`` of ``target_session``.

        Both ranges must lie inside registered regions (of this engine and of the target).

        :raises TransferError: naming the call for an unknown target session, a range outside
            the registered regions, ``nbytes <= 0``, or a closed engine.
        """
        call = f"loopback write to {target_session}"
        check_range(call, "local_ptr", local_ptr, nbytes)
        check_range(call, "remote_ptr", remote_ptr, nbytes)
        with self._fabric._lock:
            self._check_open(call)
            target = self._fabric._engines.get(target_session)
            if target is None:
                raise TransferError(f"{call}: unknown session")
            if not self._regions.covers(local_ptr, nbytes):
                raise TransferError(
                    f"{call}: local range {local_ptr:#x}+{nbytes} is not inside a region "
                    f"registered on {self._session_id}"
                )
            if not target._regions.covers(remote_ptr, nbytes):
                raise TransferError(
                    f"{call}: remote range {remote_ptr:#x}+{nbytes} is not inside a region "
                    "registered there"
                )
            # Under the fabric lock: neither region can be deregistered while it is copied.
            ctypes.memmove(remote_ptr, local_ptr, nbytes)

    def registered_regions(self) -> int:
        """How many regions are registered now."""
        with self._fabric._lock:
            return len(self._regions)

    def keep_until_closed(self, keepalive: object, ptr: int | None = None) -> None:
        """Reference ``keepalive`` until the engine closed (nothing writes into or from its
        memory then). Thread-safe."""
        self._lifetime.keep(keepalive, ptr)

    def close(self) -> None:
        """Leave the fabric and forget every registration; drop what was left to the engine.
        Idempotent.

        Later calls raise :class:`~encdisagg.TransferError`; writes to this session from other
        engines fail as writes to an unknown session.
        """
        with self._fabric._lock:
            if self._closed:
                return
            self._closed = True
            self._regions.clear()
            if self._fabric._engines.get(self._session_id) is self:
                del self._fabric._engines[self._session_id]
        # Outside the lock: every copy through this engine ran under it, and none can start.
        self._lifetime.destroyed("the loopback engine was closed")

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[LoopbackEngine]:
        """Entering is not a checkpoint; exiting closes the engine."""
        try:
            yield self
        finally:
            self.close()

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise TransferError(f"{call}: loopback engine {self._session_id} is closed")

    def __repr__(self) -> str:
        return f"<LoopbackEngine {self._session_id} regions={len(self._regions)}>"
