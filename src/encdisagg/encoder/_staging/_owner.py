"""The region owner: every engine registration the Encoder holds has one owner, here.

Who owns what, at every instant:

- the staging arena is registered once when the owner starts and deregistered once when
  it stops, when no hold is left on it (without an engine, the ZMQ-only case, it is a plain
  buffer: staging into it spares each request an allocation and its free);
- a request's own registration (arena absent or full) belongs to the request's record
  while the record lives, and moves to this owner's task when the record is freed, which
  happens only once no job of the request can touch it (``encoder/_table``). From then on only the
  owner task calls ``deregister`` on it, retrying failures with backoff; the memory stays
  alive and counted as staged until a deregistration really returned;
- a per-send registration (the request's own registration failed) lives inside one
  worker-thread call that registers, writes and deregisters; if that deregistration fails,
  or the write's outcome is unknown, the registration becomes the record's own, so later
  sends reuse it instead of registering the same pointer twice, and the record's free hands
  it over as above;
- memory a transfer may still touch (a hold, ``_held``) is never freed, reused or
  deregistered: the record's free waits for its holds to settle, and at close whatever is
  still held is left to the engine (:func:`~encdisagg.transfer.leave_with_engine`).

Registrations are :class:`~encdisagg.transfer.MemoryRegistration` objects: each call records its
own outcome in its thread, so a cancelled caller never loses one. One task serves every
deregistration, so the retries and the final sweep at close never deregister a region twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from typing import TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.abc
import anyio.to_thread
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..._config import EncoderConfig
from ..._errors import TransferError, TransferTimeoutError
from ...models._protocol import ModelOptions
from ...nurseries import run_thread_to_completion
from ...transfer import EngineOptions, Hold, MemoryRegistration, TransferEngine
from ._arena import StagingArena
from ._budget import StagedBudget
from ._held import HeldStaging
from ._staged import Handover, Staged, ThreadSafeCounter

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
        #: Whether the engine's calls may block (they then run in worker threads).
        self.blocking = EngineOptions.of(engine).blocking
        self._arena_bytes = arena_bytes
        self._device = device
        self._cleanup_timeout_s = cleanup_timeout_s
        self._clock = clock
        self.arena: StagingArena | None = None
        self._arena_registration: MemoryRegistration | None = None
        self._arena_open = False
        self._registered = ThreadSafeCounter()
        self.held = HeldStaging()
        send, receive = anyio.create_memory_object_stream[Handover](math.inf)
        self._send: MemoryObjectSendStream[Handover] = send
        self._receive: MemoryObjectReceiveStream[Handover] = receive
        #: Set once the owner task stopped serving: a late free leaves its region to the
        #: engine instead of handing it over.
        self._stopped = False
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
        device = ModelOptions.of(model).device
        return cls(
            engine,
            budget,
            arena_bytes=config.arena_bytes,
            device=device if isinstance(device, torch.device) else torch.device("cpu"),
            cleanup_timeout_s=config.cleanup_timeout_s,
            clock=anyio.current_time,
        )

    @property
    def registered(self) -> int:
        """Registrations held right now (the arena counts as one)."""
        return self._registered.value

    @property
    def held_bytes(self) -> int:
        """Bytes a transfer may still touch (held memory)."""
        return self.held.ledger.held_bytes

    async def call(
        self, func: Callable[[Unpack[Ts]], T], *args: *Ts, abandon_on_cancel: bool = False
    ) -> T:
        """Run an engine call: inline when the engine says its calls do not block, else in
        a worker thread that is never abandoned (unless ``abandon_on_cancel``, for a call
        whose memory something else keeps alive). A checkpoint only in the second case."""
        if not self.blocking:
            return func(*args)
        if abandon_on_cancel:
            return await anyio.to_thread.run_sync(func, *args, abandon_on_cancel=True)
        return await run_thread_to_completion(func, *args)

    # -- staging (on the event loop, synchronous) ---------------------------------------------

    def stage(self, req_id: str, tensor: torch.Tensor, *, copy: bool) -> Staged:
        """Count and place a fresh embedding: into an arena block when one is free, else
        as its own tensor (a copy if ``copy``, so it shares memory with nobody). A copy
        that fails (out of memory) gives its bytes and block back before it raises.

        :raises ServiceUnavailableError: it would pass the staged-memory limit.
        """
        nbytes = tensor.numel() * tensor.element_size()
        self._budget.reserve(req_id, nbytes)
        try:
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
        except BaseException:
            self._budget.give_back(nbytes)
            raise
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
        registration = self._own_registration(req_id, staged)
        # Recorded before the call: a registration the thread makes is the record's even if
        # this caller is cancelled meanwhile.
        staged.registration = registration
        try:
            await self.call(self._register_sync, registration)
        except TransferError as exc:
            staged.registration = None
            _log.warning(
                "req_id %r: registering the staged embedding failed (%s); "
                "falling back to per-send registration",
                req_id,
                exc,
            )

    def _own_registration(self, req_id: str, staged: Staged) -> MemoryRegistration:
        assert self.engine is not None
        registration = MemoryRegistration(
            self.engine,
            staged.ptr,
            staged.nbytes,
            staged.own,
            what=f"the embedding of req_id {req_id!r} ({staged.nbytes} bytes at {staged.ptr:#x})",
        )
        registration.on_deregistered = partial(self._own_gone, staged.nbytes)
        return registration

    def _register_sync(self, registration: MemoryRegistration) -> None:
        registration.register_sync()
        self._registered.add(1)

    def _own_gone(self, nbytes: int) -> None:
        # In the deregistering thread: the engine let go, the memory may go.
        self._registered.add(-1)
        self._budget.give_back(nbytes)

    def hold(self, staged: Staged, hold: Hold) -> None:
        """A transfer of ``staged`` gave up waiting and may still touch its memory. Not a
        checkpoint."""
        self.held.take(staged, hold)
        if staged.arena_offset is not None and self._arena_registration is not None:
            self._arena_registration.hold(hold)

    def free(self, req_id: str, staged: Staged) -> Handover | None:
        """The record let go of ``staged`` (no job can touch it any more). A held embedding
        waits for its holds; arena blocks and unregistered tensors go at once; an own
        registration moves to the owner task, which deregisters it: the handover is
        returned for callers that wait for it."""
        if staged.held:
            self.held.defer(req_id, staged)
            return None
        # The id's latest lifecycle ended clean: a release of it answers for that one.
        self.held.by_req_id.pop(req_id, None)
        return self._release(req_id, staged)

    def _release(self, req_id: str, staged: Staged) -> Handover | None:
        """Free ``staged``, which nothing touches any more."""
        if staged.arena_offset is not None:
            assert self.arena is not None
            self.arena.free(staged.arena_offset)
            self._budget.give_back(staged.nbytes)
            return None
        registration, staged.registration = staged.registration, None
        if registration is None or not registration.registered:
            self._budget.give_back(staged.nbytes)
            return None
        if self._stopped:
            registration.leave("the encoder closed before the request that owned it ended")
            return None
        handover = Handover(req_id, registration)
        self.unresolved.add(handover)
        self.pending[req_id] = handover
        self._send.send_nowait(handover)
        return handover

    # -- the per-send fallback (one worker-thread call) ---------------------------------------

    def write_with_own_registration(
        self, staged: Staged, target_session: str, remote_ptr: int, req_id: str
    ) -> None:
        """Register, write, deregister. Runs in a worker thread (or inline); callers of one
        record hold its fallback lock, so a pointer is never registered twice at once.

        A write whose outcome is unknown (:class:`~encdisagg.TransferTimeoutError`) leaves
        the registration in force, as the record's own: its hold keeps it."""
        engine = self.engine
        assert engine is not None
        registration = self._own_registration(req_id, staged)
        registration.on_deregistered = partial(self._registered.add, -1)
        self._register_sync(registration)
        write_error: BaseException | None = None
        try:
            engine.write(target_session, staged.ptr, remote_ptr, staged.nbytes)
        except BaseException as exc:
            write_error = exc
        if isinstance(write_error, TransferTimeoutError):
            self._adopt(staged, registration)
            raise write_error
        try:
            registration.deregister_sync()
        except Exception as exc:
            # Still registered: the record owns it from now on (later sends reuse it, the
            # record's free hands it to the owner task), and nothing is registered twice.
            self._adopt(staged, registration)
            _log.error(
                "req_id %r: deregistering the per-send region %#x failed; the request "
                "keeps it and it is deregistered when the request ends",
                req_id,
                staged.ptr,
                exc_info=exc,
            )
            if write_error is not None:
                write_error.add_note(f"deregistering the per-send region also failed: {exc!r}")
        if write_error is not None:
            raise write_error

    def _adopt(self, staged: Staged, registration: MemoryRegistration) -> None:
        registration.on_deregistered = partial(self._own_gone, staged.nbytes)
        staged.registration = registration

    # -- the owner task ----------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Register the arena, serve deregistrations and held frees until
        :meth:`stop_accepting`, then sweep (bounded by ``cleanup_timeout_s``) and
        deregister the arena."""
        try:
            await self._open_arena()
            task_status.started()
            async with anyio.create_task_group() as group:
                group.start_soon(self._serve_held)
                await self._serve()
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(self._cleanup_timeout_s):
                    await self._final_sweep()
                self._stopped = True
                self._leave_unresolved()
                # The arena is a registration of its own: it goes even when a request's
                # region is still stuck, within its own bound.
                await self._close_arena()
                self._send.close()
                self._receive.close()

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
        registration = MemoryRegistration(
            engine,
            arena.ptr,
            arena.capacity,
            arena,
            what=f"the staging arena ({arena.capacity} bytes)",
            on_deregistered=partial(self._registered.add, -1),
        )
        # Recorded before the call: if the caller is cancelled while the engine registers,
        # the close below still finds (and deregisters) what the thread registered.
        self._arena_registration = registration
        try:
            await self.call(self._register_sync, registration)
        except TransferError as exc:
            _log.warning("registering the staging arena failed (%s); each request registers", exc)
            return
        self.arena = arena
        self._arena_open = True

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

    async def _serve_held(self) -> None:
        """Complete the frees whose holds settled (they are reported from any thread)."""
        while True:
            wake = self.held.arm()
            self._free_settled()
            await wake.wait()

    def _free_settled(self) -> None:
        for req_id, staged in self.held.take_ready():
            self._release(req_id, staged)

    async def _deregister(self, handover: Handover) -> bool:
        """One attempt; whether the region is gone. Failures are logged and rescheduled."""
        try:
            # The registration keeps the memory alive until it is gone, so a call cut short
            # by the sweep's bound can be left running safely: nothing is freed under the
            # engine.
            gone = await self.call(handover.registration.deregister_sync, abandon_on_cancel=True)
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
        return gone

    def _settle(self, handover: Handover) -> None:
        if handover.deregistered:
            self.unresolved.discard(handover)
            if self.pending.get(handover.req_id) is handover:
                del self.pending[handover.req_id]

    async def _final_sweep(self) -> None:
        """Until nothing is left or the caller's bound: complete the frees whose holds
        settle, and deregister every handed-over region (retrying every 50 ms, backing off
        to 1 s)."""
        delay = 0.05
        while True:
            while True:
                try:
                    self.unresolved.add(self._receive.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            wake = self.held.arm()
            self._free_settled()
            for handover in list(self.unresolved):
                if not handover.deregistered:
                    await self._deregister(handover)
                self._settle(handover)
            if not self.unresolved and not len(self.held):
                return
            with anyio.move_on_after(delay):
                await wake.wait()
            delay = min(delay * 2, 1.0)

    def _leave_unresolved(self) -> None:
        """The sweep's bound ran out: what is still registered goes to the engine."""
        for handover in self.unresolved:
            if not handover.deregistered:
                handover.registration.leave(
                    "its deregistration failed or did not end before the encoder closed"
                )
        for req_id, staged in self.held.still_held():
            if staged.registration is not None:
                staged.registration.leave(f"a transfer of req_id {req_id!r} may still read it")

    async def _close_arena(self) -> None:
        registration = self._arena_registration
        if registration is None:
            return
        self._arena_open = False
        await registration.close(timeout_s=self._cleanup_timeout_s)
