"""The region owner: every engine registration the Encoder holds has one owner, here.

Who owns what, at every instant:

- the staging arena is registered once when the owner starts and deregistered once when
  it stops, after every block was given back (without an engine, the ZMQ-only case, it is
  a plain buffer: staging into it spares each request an allocation and its free);
- a request's own registration (arena absent or full) belongs to the request's record
  while the record lives, and moves to this owner's task when the record is freed, which
  happens only once no job of the request can touch it (``_table``). From then on only the
  owner task calls ``deregister`` on it, retrying failures with backoff; the memory stays
  alive and counted as staged until a deregistration really returned;
- a per-send registration (the request's own registration failed) lives inside one
  worker-thread call that registers, writes and deregisters; if that deregistration fails,
  the registration becomes the record's own, so later sends reuse it instead of
  registering the same pointer twice, and the record's free hands it over as above.

One task serves every deregistration, so the retries and the final sweep at close can
never deregister a region twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.abc
import anyio.to_thread
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._config import EncoderConfig
from .._errors import TransferError
from ..nurseries import run_thread_to_completion
from ..transfer import TransferEngine
from ._arena import StagingArena
from ._budget import StagedBudget
from ._staged import CallRunning, Handover, Staged, ThreadSafeCounter, calls_block

__all__ = ["RegionOwner"]

_log = logging.getLogger("encdisagg.encoder")

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

_FIRST_RETRY_S = 1.0
_MAX_RETRY_S = 60.0


class RegionOwner:
    """Stages embeddings, holds the engine's registrations and deregisters them.

    :param engine: the transfer engine (None: ZMQ only, nothing is ever registered).
    :param budget: the staged-memory budget; bytes leave it when their memory is gone.
    :param arena_bytes: size of the staging arena (0: none).
    :param device: where the arena lives (the model's device).
    :param cleanup_timeout_s: bound on the final sweep when the owner stops.
    :param clock: the event loop's clock.
    """

    def __init__(
        self,
        engine: TransferEngine | None,
        budget: StagedBudget,
        *,
        arena_bytes: int,
        device: torch.device,
        cleanup_timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.engine = engine
        self._budget = budget
        self._blocking = calls_block(engine)
        self._arena_bytes = arena_bytes
        self._device = device
        self._cleanup_timeout_s = cleanup_timeout_s
        self._clock = clock
        self.arena: StagingArena | None = None
        self._arena_open = False
        self._registered = ThreadSafeCounter()
        send, receive = anyio.create_memory_object_stream[Handover](math.inf)
        self._send: MemoryObjectSendStream[Handover] = send
        self._receive: MemoryObjectReceiveStream[Handover] = receive
        #: Handed over and not yet deregistered (pending, failed, or stuck in the engine).
        self.unresolved: set[Handover] = set()
        #: The latest handover of each request id still waiting for its deregistration, so
        #: a late release of that id can wait for it as the release that freed it would.
        self.pending: dict[str, Handover] = {}

    @classmethod
    def for_model(
        cls,
        engine: TransferEngine | None,
        budget: StagedBudget,
        model: object,
        config: EncoderConfig,
    ) -> RegionOwner:
        """An owner whose arena (``config.arena_bytes``) lives on the model's device."""
        device = getattr(model, "device", None)
        return cls(
            engine,
            budget,
            arena_bytes=config.arena_bytes,
            device=device if isinstance(device, torch.device) else torch.device("cpu"),
            cleanup_timeout_s=config.cleanup_timeout_s,
            clock=anyio.current_time,
        )

    @property
    def blocking(self) -> bool:
        """Whether the engine's calls may block (they then run in worker threads)."""
        return self._blocking

    @property
    def registered(self) -> int:
        """Registrations held right now (the arena counts as one)."""
        return self._registered.value

    async def call(self, func: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
        """Run an engine call: inline when the engine says its calls do not block, else in
        a worker thread that is never abandoned. A checkpoint only in the second case."""
        if not self._blocking:
            return func(*args)
        return await run_thread_to_completion(func, *args)

    # -- staging (on the event loop, synchronous) ---------------------------------------------

    def stage(self, req_id: str, tensor: torch.Tensor, *, copy: bool) -> Staged:
        """Count and place a fresh embedding: into an arena block when one is free, else
        as its own tensor (a copy if ``copy``, so it shares memory with nobody).

        :raises ServiceUnavailableError: it would pass the staged-memory limit.
        """
        nbytes = tensor.numel() * tensor.element_size()
        self._budget.reserve(req_id, nbytes)
        arena = self.arena
        if arena is not None and self._arena_open:
            offset = arena.stage(tensor, nbytes)
            if offset is not None:
                return Staged(
                    nbytes,
                    arena.ptr + offset,
                    tensor.dtype,
                    tuple(tensor.shape),
                    arena=arena,
                    arena_offset=offset,
                )
        if copy or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        return Staged(nbytes, int(tensor.data_ptr()), tensor.dtype, tuple(tensor.shape), own=tensor)

    async def device_finished(self, staged: Staged) -> None:
        """Wait (in a worker thread, never abandoned) until the device finished the work
        queued for ``staged``'s tensor. A checkpoint."""
        await run_thread_to_completion(torch.cuda.synchronize, staged.tensor.device)

    async def register_own(self, req_id: str, staged: Staged) -> None:
        """Register an embedding that is not in the arena; on failure, leave it to each
        send to register for itself (logged, not raised)."""
        if self.engine is None or staged.transferable:
            return
        try:
            await self.call(self._register_sync, staged)
        except TransferError as exc:
            _log.warning(
                "req_id %r: registering the staged embedding failed (%s); "
                "falling back to per-send registration",
                req_id,
                exc,
            )

    def _register_sync(self, staged: Staged) -> None:
        # Records the registration itself, so a cancellation delivered after the call
        # returned cannot lose track of it.
        assert self.engine is not None
        self.engine.register(staged.ptr, staged.nbytes)
        staged.registered = True
        self._registered.add(1)

    def free(self, req_id: str, staged: Staged) -> Handover | None:
        """The record let go of ``staged`` (no job can touch it any more). Arena blocks and
        unregistered tensors go at once; an own registration moves to the owner task,
        which deregisters it: the handover is returned for callers that wait for it."""
        if staged.arena_offset is not None:
            assert self.arena is not None
            if staged.pinned:
                _log.error(
                    "req_id %r: ZMQ never let go of its payload; its %d-byte arena block "
                    "is kept out of use (and counted as staged) for good",
                    req_id,
                    staged.nbytes,
                )
                return None
            self.arena.free(staged.arena_offset)
            self._budget.give_back(staged.nbytes)
            return None
        if not staged.registered:
            self._budget.give_back(staged.nbytes)
            return None
        handover = Handover(req_id, staged.ptr, staged.nbytes, staged.own)
        staged.registered = False
        self.unresolved.add(handover)
        self.pending[req_id] = handover
        self._send.send_nowait(handover)
        return handover

    # -- the per-send fallback (one worker-thread call) ---------------------------------------

    def write_with_own_registration(
        self, staged: Staged, target_session: str, remote_ptr: int, req_id: str
    ) -> None:
        """Register, write, deregister. Runs in a worker thread (or inline); callers of one
        record hold its fallback lock, so a pointer is never registered twice at once."""
        engine = self.engine
        assert engine is not None
        ptr, nbytes = staged.ptr, staged.nbytes
        engine.register(ptr, nbytes)
        self._registered.add(1)
        write_error: BaseException | None = None
        try:
            engine.write(target_session, ptr, remote_ptr, nbytes)
        except BaseException as exc:
            write_error = exc
        try:
            engine.deregister(ptr)
        except Exception as exc:
            # Still registered: the record owns it from now on (later sends reuse it, the
            # record's free hands it to the owner task), and nothing is registered twice.
            staged.registered = True
            _log.error(
                "req_id %r: deregistering the per-send region %#x failed; the request "
                "keeps it and it is deregistered when the request ends",
                req_id,
                ptr,
                exc_info=exc,
            )
            if write_error is not None:
                write_error.add_note(f"deregistering the per-send region also failed: {exc!r}")
        else:
            self._registered.add(-1)
        if write_error is not None:
            raise write_error

    # -- the owner task ----------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Register the arena, serve deregistrations until :meth:`stop_accepting`, then
        sweep (bounded by ``cleanup_timeout_s``) and deregister the arena."""
        try:
            await self._open_arena()
            task_status.started()
            await self._serve()
        finally:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(self._cleanup_timeout_s):
                    await self._final_sweep()
                # The arena is a registration of its own: it goes even when a request's
                # region is still stuck, within its own bound.
                with anyio.move_on_after(self._cleanup_timeout_s) as bound:
                    await self._close_arena()
                if bound.cancelled_caught:
                    _log.error(
                        "deregistering the staging arena took over %s s; it stays registered",
                        self._cleanup_timeout_s,
                    )
                self._send.close()
                self._receive.close()
                self._report_unresolved()

    def stop_accepting(self) -> None:
        """No more handovers will come; the owner task sweeps and ends. Not a checkpoint."""
        self._send.close()

    async def _open_arena(self) -> None:
        engine = self.engine
        if self._arena_bytes <= 0:
            return
        # In a worker thread: on an accelerator the allocation may wait for the device.
        arena = await run_thread_to_completion(StagingArena, self._arena_bytes, self._device)
        if engine is None:
            # Nothing to register: ZMQ sends from any memory.
            self.arena = arena
            self._arena_open = True
            return
        try:
            await self.call(engine.register, arena.ptr, arena.capacity)
        except TransferError as exc:
            _log.warning("registering the staging arena failed (%s); each request registers", exc)
            return
        self.arena = arena
        self._arena_open = True
        self._registered.add(1)

    async def _serve(self) -> None:
        pending: list[Handover] = []
        while True:
            handover: Handover | None = None
            delay = min((h.next_try for h in pending), default=math.inf) - self._clock()
            with anyio.move_on_after(max(delay, 0.0)):
                try:
                    handover = await self._receive.receive()
                except anyio.EndOfStream:
                    return
            if handover is not None:
                pending.append(handover)
            now = self._clock()
            for due in [h for h in pending if h.next_try <= now]:
                if await self._deregister(due):
                    pending.remove(due)

    async def _deregister(self, handover: Handover) -> bool:
        """One attempt; whether the region is gone. Failures are logged and rescheduled."""
        try:
            await self._run_abandonable(self._deregister_sync, handover)
        except CallRunning:
            return False
        except Exception as exc:
            handover.attempts += 1
            backoff = min(_FIRST_RETRY_S * 2 ** (handover.attempts - 1), _MAX_RETRY_S)
            handover.next_try = self._clock() + backoff
            if handover.attempts == 1:
                _log.error(
                    "req_id %r: deregistering its staged embedding failed (region %#x); "
                    "keeping the memory and retrying in %.1f s",
                    handover.req_id,
                    handover.ptr,
                    backoff,
                    exc_info=exc,
                )
            else:
                _log.warning(
                    "req_id %r: retrying the deregistration of region %#x failed "
                    "(attempt %d, next in %.1f s): %s",
                    handover.req_id,
                    handover.ptr,
                    handover.attempts,
                    backoff,
                    exc,
                )
            return False
        finally:
            handover.attempted.set()
            self._settle(handover)
        return True

    def _deregister_sync(self, handover: Handover) -> None:
        # Never two calls on one region at once, never one after it succeeded.
        assert self.engine is not None
        if not handover.lock.acquire(blocking=False):
            raise CallRunning
        try:
            if not handover.deregistered:
                self.engine.deregister(handover.ptr)
                # Settled here, not on the event loop: a call the sweep's bound left
                # running still gives its bytes back when the engine lets go.
                handover.deregistered = True
                handover.tensor = None
                self._registered.add(-1)
                self._budget.give_back(handover.nbytes)
        finally:
            handover.lock.release()

    def _settle(self, handover: Handover) -> None:
        if handover.deregistered:
            self.unresolved.discard(handover)
            if self.pending.get(handover.req_id) is handover:
                del self.pending[handover.req_id]

    async def _run_abandonable(self, func: Callable[[Unpack[Ts]], None], *args: *Ts) -> None:
        # The thread's own arguments keep the memory alive, so a call cut short by the
        # sweep's bound can be left running safely: nothing is freed under the engine.
        if not self._blocking:
            func(*args)
            return
        await anyio.to_thread.run_sync(func, *args, abandon_on_cancel=True)

    async def _final_sweep(self) -> None:
        while True:
            try:
                self.unresolved.add(self._receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        delay = 0.05
        while True:
            for handover in list(self.unresolved):
                if not handover.deregistered:
                    await self._deregister(handover)
                self._settle(handover)
            if not self.unresolved:
                break
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _close_arena(self) -> None:
        arena, engine = self.arena, self.engine
        if arena is None or engine is None or not self._arena_open:
            return
        if arena.allocated:
            _log.error("the staging arena still holds %d blocks; keeping it", arena.allocated)
            return
        try:
            await self._run_abandonable(_deregister_arena, engine, arena)
        except Exception as exc:
            _log.error("deregistering the staging arena failed; keeping it", exc_info=exc)
            return
        self._arena_open = False
        self._registered.add(-1)

    def _report_unresolved(self) -> None:
        for handover in self.unresolved:
            if not handover.deregistered:
                _log.error(
                    "region %#x (%d bytes) was not deregistered before shutdown (failed, or "
                    "the engine still holds the call); its memory is kept until it is",
                    handover.ptr,
                    handover.nbytes,
                )


def _deregister_arena(engine: TransferEngine, arena: StagingArena) -> None:
    engine.deregister(arena.ptr)
