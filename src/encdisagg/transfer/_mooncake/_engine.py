"""The Mooncake transfer engine (TCP or RDMA), wrapped as a :class:`TransferEngine`."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Final, Protocol, cast, final

import anyio
import anyio.lowlevel

from ..._errors import TransferError, TransferTimeoutError
from ..._numbers import real
from ...nurseries import run_thread_to_completion
from .._lifetime import EngineLifetime, close_in_thread
from .._regions import RegionTable, check_range
from ._listen import keep_listeners_to_host, socket_inodes
from ._native_logs import native_lines_to_logging, quiet_mooncake_by_default
from ._waiter import (
    DONE,
    FAILED,
    STILL_RUNNING,
    TIMED_OUT,
    CompletionWaiter,
    block_until_ended,
    poll_on_loop,
)

__all__ = ["MooncakeEngine"]

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"

#: What ``transfer_submit_write`` returns instead of a batch id when it fails (0 in the
#: 0.3 wheels, -1 as a 64-bit unsigned batch id upstream).
_NO_BATCH: Final = frozenset({0, -1, (1 << 64) - 1})
#: Writes up to this size are submitted on the event loop, larger ones in a worker thread.
#: A submit only queues the write for Mooncake's transport threads: over loopback TCP it
#: took 10-40 µs whatever the size (1 to 64 MiB); over RDMA it posts work requests.
SUBMIT_ON_LOOP_MAX_BYTES: Final = 1 << 30
#: How long a write is polled on the event loop before the completion thread takes it over:
#: longer than a 64 MiB write over loopback TCP (about 40 ms), so only a slow or stuck write
#: moves to the thread.
POLL_ON_LOOP_S: Final = 0.1


class _MooncakeApi(Protocol):
    """The part of ``mooncake.engine.TransferEngine`` (pybind) that is used here.

    Every call returns an int rc: 0 is success, anything else a failure. None raises.
    """

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    def register_memory(self, buffer_addr: int, capacity: int, /) -> int: ...
    def unregister_memory(self, buffer_addr: int, /) -> int: ...
    def transfer_submit_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, /
    ) -> int: ...
    def transfer_check_status(self, batch_id: int, /) -> int: ...


def _create_mooncake() -> _MooncakeApi:
    quiet_mooncake_by_default()  # before the import: Mooncake reads its level when it loads
    try:
        from mooncake.engine import TransferEngine as _Engine
    except ImportError as exc:
        raise ImportError(
            "MooncakeEngine needs the Mooncake transfer engine: install "
            "'encdisagg[mooncake-cpu]' (and the system library libibverbs1) on CPU hosts, or "
            f"'encdisagg[mooncake]' on CUDA hosts. Importing it failed: {exc}"
        ) from exc
    return cast(_MooncakeApi, _Engine())


@final
class MooncakeEngine(anyio.AsyncContextManagerMixin):
    """A :class:`~encdisagg.transfer.TransferEngine` over Mooncake's transfer engine.

    Use it as ``async with MooncakeEngine(...) as engine:``. Entering imports Mooncake and
    initializes the engine in a worker thread (a checkpoint; a cancelled start still stops
    what it started). Exiting deregisters whatever is still registered and drops the engine,
    in a shielded worker-thread call bounded by ``close_timeout_s``.

    :meth:`register`, :meth:`deregister` and :meth:`write` block and are thread-safe; call
    them from worker threads. Every Mooncake rc other than 0 raises
    :class:`~encdisagg.TransferError` naming the call and the rc. Besides Mooncake's own
    checks, :meth:`write` also requires its local range to lie in a region registered here:
    Mooncake's TCP transport does not check that, RDMA does.

    :meth:`write_async` is the same write made from the event loop without a worker thread
    per call (the Encoder uses it when an engine has one). Both submit the write and check
    its status until Mooncake reports it ended, so a failed write and one whose outcome is
    unknown stay apart: a write still running when Mooncake's own bound passed, or that
    Mooncake reports timed out, raises :class:`~encdisagg.TransferTimeoutError` with a
    :class:`~encdisagg.transfer.Hold` on its local memory. The engine goes on checking it
    and settles the hold once Mooncake reports it done or failed; closing the engine
    settles every hold left, once the Mooncake engine was destroyed (its threads joined),
    and until then leaves their regions registered.

    Leaving the ``async with`` block waits until every write in flight ended or outlived
    its bound, then deregisters what is still registered (not held), destroys the
    Mooncake engine, and only then drops what was left to it (:meth:`keep_until_closed`).

    :param hostname: the local host (``"host"`` or ``"host:port"``) given to Mooncake. Its
        handshake and TCP data ports answer only connections to this host (Mooncake binds
        them to every interface; a socket filter drops the rest), unless it is a wildcard.
    :param metadata_server: ``"P2PHANDSHAKE"`` (no metadata server) or the metadata server's
        URL, e.g. ``"http://host:port/metadata"``.
    :param protocol: ``"tcp"`` or ``"rdma"``.
    :param device_name: RDMA device(s); empty for TCP.
    :param close_timeout_s: the bound on deregistering leftovers at exit.
    :param submit_on_loop_max_bytes: :meth:`write_async` submits writes up to this size on
        the event loop, larger ones from a worker thread (0: always from a thread).
    :param poll_on_loop_s: how long :meth:`write_async` checks a submitted write once per
        event-loop turn before the engine's completion thread polls it instead (0: always
        the thread). Polling on the loop keeps a core busy while a write runs, as Mooncake's
        own synchronous write does, but sees the write done a turn after it ended.
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        metadata_server: str = P2P_HANDSHAKE,
        protocol: str = "tcp",
        device_name: str = "",
        *,
        close_timeout_s: float = 10.0,
        submit_on_loop_max_bytes: int = SUBMIT_ON_LOOP_MAX_BYTES,
        poll_on_loop_s: float = POLL_ON_LOOP_S,
    ) -> None:
        real("poll_on_loop_s", poll_on_loop_s, least=0, finite=False)
        self._hostname = hostname
        self._metadata_server = metadata_server
        self._protocol = protocol
        self._device_name = device_name
        self._close_timeout_s = close_timeout_s
        self._submit_on_loop_max_bytes = submit_on_loop_max_bytes
        self._poll_on_loop_s = poll_on_loop_s
        self._transfer_timeout_s = _mooncake_transfer_timeout_s()
        self._lock = threading.Lock()
        # Guarded by _lock. _engine is set while the engine runs. _used turns True when the
        # context is first entered (an engine starts once), _closed when it is left.
        self._engine: _MooncakeApi | None = None
        self._session_id: str | None = None
        self._used = False
        self._closed = False
        self._regions = RegionTable()
        # Sessions a write reached: Mooncake holds an open segment for them, so a submit
        # needs no handshake (a blocking RPC). A failed write forgets its session.
        self._connected: set[str] = set()
        self._waiter = CompletionWaiter()
        # Writes in flight, holds on writes whose outcome is unknown, memory left here.
        self._lifetime = EngineLifetime()

    @property
    def poll_on_loop_s(self) -> float:
        """How long :meth:`write_async` checks a write on the event loop (the constructor's
        ``poll_on_loop_s``)."""
        return self._poll_on_loop_s

    @property
    def session_id(self) -> str:
        """How peers address this engine: ``"host:rpc_port"`` in P2PHANDSHAKE mode, else the
        ``hostname`` given to Mooncake.

        :raises TransferError: if the engine is not running.
        """
        with self._lock:
            self._require("session_id")
            assert self._session_id is not None
            return self._session_id

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` at ``ptr`` with Mooncake. Blocks.

        :raises TransferError: for ``nbytes <= 0``, a bad address, an overlap with (or a repeat
            of) a registered region, a failing rc, or an engine that is not running.
        """
        call = "mooncake register_memory"
        check_range(call, "ptr", ptr, nbytes)
        with self._lock:
            engine = self._require(call)
            self._regions.refuse_overlap(call, ptr, nbytes)
            rc = engine.register_memory(ptr, nbytes)
            if rc != 0:
                raise TransferError(f"{call} of {ptr:#x} ({nbytes} bytes) failed (rc={rc})")
            self._regions.add(ptr, nbytes)

    def deregister(self, ptr: int) -> None:
        """Deregister the region registered at ``ptr``. Blocks.

        A region whose deregistration fails stays recorded, so a retry (or the engine's exit)
        tries again.

        :raises TransferError: if no region starts at ``ptr`` (also after it was deregistered),
            for a failing rc, or an engine that is not running.
        """
        call = "mooncake unregister_memory"
        with self._lock:
            engine = self._require(call)
            self._regions.refuse_unknown(call, ptr)
            rc = engine.unregister_memory(ptr)
            if rc != 0:
                raise TransferError(f"{call} of {ptr:#x} failed (rc={rc})")
            self._regions.remove(ptr)

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        """Write ``nbytes`` from ``local_ptr`` into ``remote_ptr`` of ``target_session``.

        Blocks until Mooncake reports the write ended: submitted (the first write to a
        session opens it with a handshake), then its status checked, sleeping in between,
        for at most Mooncake's own bound on a synchronous write (``MC_TRANSFER_TIMEOUT``, 30 s
        by default, plus a second per GiB).

        :raises TransferError: naming the call, the target and the rc when Mooncake fails (an
            unreachable session, a remote range outside the peer's registered memory), and
            for a local range outside this engine's registered regions.
        :raises TransferTimeoutError: the bound passed, or Mooncake reported a timeout: the
            write may still read the local memory; its ``hold`` settles once Mooncake
            reports it ended, or when this engine is destroyed.
        """
        call = f"mooncake write to {target_session}"
        engine, _ = self._begin_write(call, target_session, local_ptr, remote_ptr, nbytes)
        try:
            batch = self._submit(engine, call, target_session, local_ptr, remote_ptr, nbytes)
            bound = time.monotonic() + self._write_bound_s(nbytes)
            rc = block_until_ended(engine, batch, bound)
            self._conclude(engine, call, target_session, batch, rc, local_ptr, nbytes)
        finally:
            self._lifetime.end_write()

    async def write_async(
        self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int
    ) -> None:
        """:meth:`write`, awaited on the event loop instead of blocking a worker thread.

        The submit runs on the event loop for an open session (it only queues the write),
        in a worker thread for the first write to a session (Mooncake opens it with a
        handshake, a blocking RPC) or one over ``submit_on_loop_max_bytes``. Unless Mooncake
        reports the write done at once, this task checks it (``transfer_check_status``)
        once per event-loop turn, yielding in between, for up to ``poll_on_loop_s``; a write
        still running then is polled by the engine's completion thread (with every other
        write handed to it), which wakes this task when the write ended. Always a
        cancellation point; a checkpoint (it yields to other tasks) unless Mooncake reported
        the write done right after submitting it.

        Once submitted, the write runs to its end: cancelling the caller (once or many times)
        takes effect only after Mooncake reported it done or failed, or after the write
        outlived Mooncake's own bound, so the caller that sees the cancellation knows where
        the memory stands.

        :raises TransferError: as :meth:`write`.
        :raises TransferTimeoutError: as :meth:`write`: the memory is held.
        """
        call = f"mooncake write to {target_session}"
        engine, connected = self._begin_write(call, target_session, local_ptr, remote_ptr, nbytes)
        try:
            with anyio.CancelScope(shield=True):
                # Shielded from the submit on: a submitted write cannot be called back, so the
                # caller must not return before it ended or outlived its bound.
                args = (engine, call, target_session, local_ptr, remote_ptr, nbytes)
                if connected and nbytes <= self._submit_on_loop_max_bytes:
                    batch = self._submit(*args)
                else:
                    batch = await run_thread_to_completion(self._submit, *args)
                rc = engine.transfer_check_status(batch)
                if rc not in (DONE, FAILED, TIMED_OUT):
                    # Still running (a TCP submit often sent the bytes already, then it ended).
                    timeout_s = self._write_bound_s(nbytes)
                    polled_s = min(self._poll_on_loop_s, timeout_s)
                    rc = await poll_on_loop(engine, batch, time.monotonic() + polled_s)
                    if rc == STILL_RUNNING:
                        rc = await self._waiter.wait(engine, batch, timeout_s - polled_s)
                self._conclude(engine, call, target_session, batch, rc, local_ptr, nbytes)
        finally:
            self._lifetime.end_write()
        # A cancellation that arrived meanwhile is delivered now the write ended.
        await anyio.lowlevel.checkpoint_if_cancelled()

    def _submit(
        self,
        engine: _MooncakeApi,
        call: str,
        target_session: str,
        local_ptr: int,
        remote_ptr: int,
        nbytes: int,
    ) -> int:
        """Submit the write; its batch id. :raises TransferError: Mooncake refused it."""
        batch = engine.transfer_submit_write(target_session, local_ptr, remote_ptr, nbytes)
        if batch in _NO_BATCH:
            self._forget(target_session)
            raise TransferError(f"{call} failed (batch id {batch})")
        return batch

    def _conclude(
        self,
        engine: _MooncakeApi,
        call: str,
        target_session: str,
        batch: int,
        rc: int,
        local_ptr: int,
        nbytes: int,
    ) -> None:
        """What a write's last status means: done, failed, or an unknown outcome (held)."""
        if rc == DONE:
            with self._lock:
                self._connected.add(target_session)
            return
        self._forget(target_session)
        if rc == FAILED:
            raise TransferError(f"{call} failed (rc={rc})")
        what = "timed out (rc=-2)" if rc == TIMED_OUT else "did not end in time"
        hold = self._lifetime.hold(
            f"{nbytes} bytes at {local_ptr:#x} (a write to {target_session})", local_ptr, nbytes
        )
        # Mooncake frees a batch that ended: a timed-out one is not freed, so checking it
        # again is safe, and the only way to learn that its slices stopped.
        if not self._waiter.watch(engine, batch, hold):
            logger.error(
                "%s: the engine is closing, so the write that outlived its bound is not "
                "checked again; its memory stays held until the engine was destroyed",
                call,
            )
        raise TransferTimeoutError(
            f"{call} {what}; Mooncake may still read the local memory, which stays held "
            "until Mooncake reports the write ended or the engine is closed",
            hold=hold,
        )

    def _write_bound_s(self, nbytes: int) -> float:
        """Mooncake's own bound on a synchronous write of ``nbytes``."""
        return self._transfer_timeout_s + nbytes / (1 << 30)

    def _begin_write(
        self, call: str, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int
    ) -> tuple[_MooncakeApi, bool]:
        """The running engine for a write the arguments allow, and whether the session is
        open already; the write counts as in flight until its lifetime's ``end_write()``.

        :raises TransferError: naming ``call`` for a bad argument, a stopped engine, or a local
            range outside this engine's registered regions."""
        if not isinstance(target_session, str) or not target_session:
            raise TransferError(f"{call}: target_session must be a non-empty str")
        check_range(call, "local_ptr", local_ptr, nbytes)
        check_range(call, "remote_ptr", remote_ptr, nbytes)
        with self._lock:
            engine = self._require(call)
            if not self._regions.covers(local_ptr, nbytes):
                raise TransferError(
                    f"{call}: local range {local_ptr:#x}+{nbytes} is not inside a registered region"
                )
            self._lifetime.begin_write()
            return engine, target_session in self._connected

    def keep_until_closed(self, keepalive: object, ptr: int | None = None) -> None:
        """Reference ``keepalive`` until the Mooncake engine was destroyed (nothing touches
        memory through it then); the region registered at ``ptr``, if given, stays
        registered until then. Dropped at once if the engine is gone already. Thread-safe."""
        self._lifetime.keep(keepalive, ptr)

    @property
    def unsettled(self) -> int:
        """Writes whose outcome is unknown and that the engine still holds memory for."""
        return self._lifetime.unsettled

    def _forget(self, target_session: str) -> None:
        with self._lock:
            self._connected.discard(target_session)

    def registered_regions(self) -> int:
        """How many regions are registered now."""
        with self._lock:
            return len(self._regions)

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[MooncakeEngine]:
        with self._lock:
            if self._used:
                raise TransferError("a MooncakeEngine starts once; create a new one")
            self._used = True
        try:
            await run_thread_to_completion(self._start)
            yield self
        finally:
            # Abandoning on the deadline is what bounds the exit: a hung Mooncake call
            # must not hang shutdown. The engine is already detached at that point.
            if not await close_in_thread(self._stop, self._close_timeout_s):
                logger.error(
                    "MooncakeEngine %s: closing did not finish within %s s",
                    self._session_id,
                    self._close_timeout_s,
                )

    def _start(self) -> None:
        # Mooncake's start-up lines go to Python's logging (debug level unless it fails).
        with native_lines_to_logging():
            engine = _create_mooncake()
            sockets_before = socket_inodes()
            rc = engine.initialize(
                self._hostname, self._metadata_server, self._protocol, self._device_name
            )
            if rc != 0:
                raise TransferError(
                    f"mooncake initialize of {self._hostname} ({self._protocol}, "
                    f"{self._metadata_server}) failed (rc={rc})"
                )
        self._waiter.start()
        host, _, port = self._hostname.rpartition(":")
        host = host if host and port.isdigit() else self._hostname
        # Before the engine is published: nothing reaches it through another interface.
        keep_listeners_to_host(host, sockets_before, engine.get_rpc_port())
        if self._metadata_server == P2P_HANDSHAKE:
            session_id = f"{host}:{engine.get_rpc_port()}"
        else:
            session_id = self._hostname
        with self._lock:
            self._engine = engine
            self._session_id = session_id

    def _stop(self) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
            self._closed = True
            self._connected.clear()
            leftovers = self._regions.items()
            self._regions.clear()
        # Every write is bounded by Mooncake's own timeout: the engine outlives them all.
        self._lifetime.wait_writes_ended()
        self._waiter.stop()
        if engine is not None:
            for ptr, nbytes in leftovers:
                if self._lifetime.spares(ptr, nbytes):
                    continue
                rc = engine.unregister_memory(ptr)
                if rc != 0:
                    logger.error(
                        "MooncakeEngine %s: unregister_memory of %#x (%d bytes) failed at exit "
                        "(rc=%d)",
                        self._session_id,
                        ptr,
                        nbytes,
                        rc,
                    )
            # Dropping the last reference here, in the worker thread, lets Mooncake join its
            # threads (about a second) off the event loop. Once joined, no slice of any
            # write touches memory any more: what was held may go.
            del engine
        self._lifetime.destroyed("the Mooncake engine was destroyed")

    def _require(self, call: str) -> _MooncakeApi:
        if self._engine is None:
            if self._closed:
                state = "closed"
            elif self._used:
                state = "starting"
            else:
                state = "not started (use 'async with')"
            raise TransferError(f"{call}: the MooncakeEngine is {state}")
        return self._engine

    def __repr__(self) -> str:
        return f"<MooncakeEngine {self._session_id or self._hostname} regions={len(self._regions)}>"


def _mooncake_transfer_timeout_s() -> float:
    """Mooncake's own bound on a synchronous write: ``MC_TRANSFER_TIMEOUT`` seconds (at
    least 5), 30 by default."""
    try:
        return float(max(5, int(os.environ["MC_TRANSFER_TIMEOUT"])))
    except (KeyError, ValueError):
        return 30.0
