"""One buffer registered with one transfer engine: made once, dropped once, never while held.

Every side registers memory this way: the encoder's staging arena and its requests' own
regions, the receiver's landing pool, the decode side's KV pages and metadata rows, prefill's
KV staging. The rules live here, once:

- the engine calls run in worker threads that are never abandoned (inline for an engine whose
  ``blocking`` is False), and the thread records what it did, so a caller cancelled while the
  engine worked can never lose track of a registration it made;
- at most one engine call runs on a registration at a time, and it is deregistered at most
  once, only when no :class:`~encdisagg.transfer.Hold` is on it;
- the buffer (``keepalive``) stays referenced until the deregistration returned; should the
  registration outlive its owner's bound (held, or the engine keeps failing), it is left to
  the engine (:func:`~encdisagg.transfer.leave_with_engine`), never freed under it.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, final

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._errors import InternalError, TransferError
from ..nurseries import ThreadSafeEvent, run_thread_to_completion
from ._engine import EngineOptions
from ._holds import Hold
from ._lifetime import leave_with_engine

if TYPE_CHECKING:
    from ._engine import TransferEngine

__all__ = ["MemoryRegistration", "MemoryRegistrationState"]

_log = logging.getLogger("encdisagg.transfer")

_FIRST_RETRY_S = 0.05
_MAX_RETRY_S = 1.0


class MemoryRegistrationState(enum.Enum):
    """Where a registration stands. It only moves forward."""

    NEW = "new"
    REGISTERED = "registered"
    DEREGISTERED = "deregistered"
    #: Its owner's bound ran out before it could be deregistered: the engine keeps it.
    LEFT = "left"


@final
class MemoryRegistration:
    """``nbytes`` at ``ptr``, registered with ``engine`` for one owner.

    :param engine: the transfer engine.
    :param ptr: the buffer's address.
    :param nbytes: its size.
    :param keepalive: the object that owns the memory (a tensor): referenced until the
        registration is gone, so the memory cannot be freed while it is registered.
    :param what: the buffer, for logs and errors (``"the landing pool (256 x 16384 B)"``).
    :param on_deregistered: called once, in the thread that deregistered (inside the call,
        so exactly once), right after the engine let go of the buffer.
    """

    __slots__ = (
        "_call_lock",
        "_holds",
        "_keepalive",
        "_lock",
        "_state",
        "blocking",
        "engine",
        "nbytes",
        "on_deregistered",
        "ptr",
        "what",
    )

    def __init__(
        self,
        engine: TransferEngine,
        ptr: int,
        nbytes: int,
        keepalive: object,
        *,
        what: str,
        on_deregistered: Callable[[], object] | None = None,
    ) -> None:
        self.engine = engine
        self.ptr = ptr
        self.nbytes = nbytes
        self.what = what
        self.blocking = EngineOptions.of(engine).blocking
        self._keepalive: object = keepalive
        #: Called once, in the thread that deregistered, right after the engine let go (an
        #: owner may replace it while the registration is still in force).
        self.on_deregistered = on_deregistered
        self._state = MemoryRegistrationState.NEW
        # _lock guards _state and _holds; _call_lock is held by the one engine call running.
        self._lock = threading.Lock()
        self._call_lock = threading.Lock()
        self._holds: set[Hold] = set()

    @property
    def state(self) -> MemoryRegistrationState:
        return self._state

    @property
    def registered(self) -> bool:
        """Whether the engine holds the registration (also when it was left to it)."""
        return self._state in (MemoryRegistrationState.REGISTERED, MemoryRegistrationState.LEFT)

    @property
    def held(self) -> bool:
        """Whether a transfer may still touch part of the buffer."""
        return bool(self._holds)

    @property
    def keepalive(self) -> object:
        """What owns the memory (None once the registration is gone)."""
        return self._keepalive

    # -- holds ------------------------------------------------------------------------------

    def hold(self, hold: Hold) -> None:
        """Part of the buffer is under ``hold``: it is not deregistered before the hold
        settles, and the hold keeps the buffer alive. Not a checkpoint; thread-safe."""
        hold.keep(self._keepalive)
        with self._lock:
            if hold.settled:
                return
            self._holds.add(hold)
        hold.on_settled(self._settled)

    def _settled(self, hold: Hold) -> None:
        with self._lock:
            self._holds.discard(hold)

    # -- the engine calls, as blocking bodies that record their own outcome -----------------

    def register_sync(self) -> None:
        """Register (blocking; the outcome is recorded before this returns).

        :raises TransferError: the engine refused; nothing is registered.
        :raises InternalError: registered before.
        """
        with self._call_lock:
            if self._state is not MemoryRegistrationState.NEW:
                raise InternalError(f"{self.what} was registered before ({self._state.value})")
            self.engine.register(self.ptr, self.nbytes)
            with self._lock:
                self._state = MemoryRegistrationState.REGISTERED

    def deregister_sync(self) -> bool:
        """One deregistration attempt (blocking): whether the registration is gone now.

        False, without calling the engine, while a hold is on the buffer or another call
        runs on this registration. True at once for a registration never made.

        :raises TransferError: the engine failed; the registration is kept (try again).
        """
        if not self._call_lock.acquire(blocking=False):
            return False
        try:
            with self._lock:
                state = self._state
                if state is MemoryRegistrationState.NEW:
                    self._state = MemoryRegistrationState.DEREGISTERED
                    self._keepalive = None
                    return True
                if state is MemoryRegistrationState.DEREGISTERED:
                    return True
                if self._holds:
                    return False
            self.engine.deregister(self.ptr)
            with self._lock:
                self._state = MemoryRegistrationState.DEREGISTERED
                # The memory may go now: the engine let go of it.
                self._keepalive = None
            if self.on_deregistered is not None:
                self.on_deregistered()
            return True
        finally:
            self._call_lock.release()

    # -- async around them ------------------------------------------------------------------

    async def open(self) -> None:
        """Register. A checkpoint for a blocking engine; if the caller is cancelled, it
        returns only once the engine returned, and a registration made is recorded.

        :raises TransferError: the engine refused.
        """
        if not self.blocking:
            self.register_sync()
            return
        await run_thread_to_completion(self.register_sync)

    async def close(self, *, timeout_s: float) -> bool:
        """Deregister once no hold is left. Shielded; bounded by ``timeout_s``.

        Waits for the holds on the buffer to settle, then deregisters, retrying a failed
        attempt (every 50 ms, backing off to 1 s). A deregistration still in the engine when
        the bound runs out is left running in its thread (its arguments keep the memory
        alive). Past the bound the registration is left to the engine, kept until it
        closes, and logged; nothing is freed. A checkpoint.

        :return: whether the registration is gone.
        """
        if self._gone():
            await anyio.lowlevel.checkpoint()
            return True
        delay = _FIRST_RETRY_S
        failure: BaseException | None = None
        with anyio.move_on_after(timeout_s, shield=True):
            while True:
                await self._settle_holds()
                try:
                    if await self._attempt():
                        return True
                except TransferError as exc:
                    if failure is None:
                        _log.error("deregistering %s failed; retrying", self.what, exc_info=exc)
                    failure = exc
                await anyio.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_S)
        if self._gone():
            # A call the bound left running deregistered it after all.
            return True
        self.leave("it is still held" if self._holds else f"deregistering it failed: {failure!r}")
        return False

    def _gone(self) -> bool:
        # Read afresh each time: a thread the bound left running may have deregistered it.
        with self._lock:
            return self._state is MemoryRegistrationState.DEREGISTERED

    def leave(self, why: str) -> None:
        """Leave the registration to its engine, unless it is gone already. Not a checkpoint."""
        with self._lock:
            if self._state is not MemoryRegistrationState.REGISTERED:
                return
            self._state = MemoryRegistrationState.LEFT
        leave_with_engine(self.engine, self, what=f"{self.what} ({why})", ptr=self.ptr)

    async def _settle_holds(self) -> None:
        while True:
            with self._lock:
                holds = tuple(self._holds)
            if not holds:
                return
            # Woken when any of the holds settles.
            changed = ThreadSafeEvent()
            for hold in holds:
                hold.on_settled(partial(_wake, changed))
            await changed.wait()

    async def _attempt(self) -> bool:
        if not self.blocking:
            return self.deregister_sync()
        # Abandoned only when the bound runs out: the thread's arguments keep the memory.
        return await anyio.to_thread.run_sync(self.deregister_sync, abandon_on_cancel=True)

    def __repr__(self) -> str:
        return f"<MemoryRegistration {self.what} {self.ptr:#x}+{self.nbytes} {self._state.value}>"


def _wake(event: ThreadSafeEvent, hold: Hold) -> None:
    event.set_from_thread()
