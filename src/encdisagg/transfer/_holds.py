"""Holds: memory a transfer may still touch after the code that waited for it gave up.

A transfer cannot always be called back. Stock Mooncake runs a write until its slices end: its
synchronous call gives up after its own wall-clock bound while slices may still fly, and a
submitted write that reports a timeout is not over either. ZMQ may keep a zero-copy frame
after the send that made it gave up. A remote encoder may still write into landing pages whose
release it did not confirm, and a prefill rank into decode pages until it acks an abort. In
each case nobody knows when the memory stops being touched.

A :class:`Hold` is that state, written once and used by every side:

- it keeps the memory alive: the objects owning the bytes are referenced by the hold itself
  (:meth:`Hold.keep`), so no owner that closes, is dropped or is collected can free them;
- the memory's owner never frees, reuses or deregisters held memory, and learns through
  :meth:`Hold.on_settled` when it may;
- only the event that proves nothing touches the memory any more settles it
  (:meth:`Hold.settle`): the transfer's terminal status, a drain acknowledgement, the
  destruction of the engine itself. A bound running out proves nothing: what a side does
  then is its :class:`HoldPolicy`.

:class:`HeldLedger` counts the holds of one owner (``held_bytes``) and logs each once.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from typing import final

__all__ = ["HeldLedger", "Hold", "HoldPolicy"]

_log = logging.getLogger("encdisagg.transfer")


class HoldPolicy(enum.Enum):
    """What a side does with held memory once its own bound ran out without proof."""

    #: Keep it out of use: retired until proof arrives, or until the engine it is
    #: registered with is destroyed. No late write can land in another request's memory.
    RETIRE = "retire"
    #: Give it back to use, as SGLang's decode side does: a late write may land in memory
    #: handed to another request (logged when it happens).
    REUSE = "reuse"

    @classmethod
    def parse(cls, value: HoldPolicy | str, *, field: str = "hold_policy") -> HoldPolicy:
        """``value`` as a policy. :raises ValueError: naming ``field`` for another value."""
        if isinstance(value, HoldPolicy):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(policy.value) for policy in cls)
            raise ValueError(f"{field} must be one of {choices}; got {value!r}") from None


@final
class Hold:
    """Memory a transfer may still touch. Settled once, by proof that it stopped.

    Thread-safe: an engine's own thread may settle it. Callbacks run in the settling thread
    (or at once, in the caller's, when it settled already); owners whose state lives on an
    event loop hand the news over to their loop.

    :param what: the memory and the transfer, for logs (``"req_id 'r': 4096 bytes at 0x…"``).
    :param nbytes: how many bytes it holds.
    """

    __slots__ = ("_callbacks", "_kept", "_lock", "_reason", "nbytes", "what")

    def __init__(self, what: str, nbytes: int = 0) -> None:
        self.what = what
        self.nbytes = nbytes
        self._lock = threading.Lock()
        # Guarded by _lock; _reason is None until settled.
        self._reason: str | None = None
        self._kept: list[object] = []
        self._callbacks: list[Callable[[Hold], object]] = []

    @property
    def settled(self) -> bool:
        """Whether proof came that nothing touches the memory any more."""
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        """What settled it (None while held)."""
        return self._reason

    def keep(self, *objects: object) -> None:
        """Keep ``objects`` (what owns the memory) referenced until the hold settles; nothing
        is kept once it settled already."""
        with self._lock:
            if self._reason is None:
                self._kept.extend(objects)

    def on_settled(self, callback: Callable[[Hold], object]) -> None:
        """Call ``callback(hold)`` once the hold settles: in the settling thread, or right
        here when it settled already. A callback that raises is logged."""
        with self._lock:
            if self._reason is None:
                self._callbacks.append(callback)
                return
        _call(callback, self)

    def settle(self, reason: str) -> bool:
        """Proof came that nothing touches the memory: run the callbacks, then drop what was
        kept. Whether this call settled it (a second call changes nothing)."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
            callbacks, self._callbacks = self._callbacks, []
            kept, self._kept = self._kept, []
        for callback in callbacks:
            _call(callback, self)
        # The memory goes only after every owner was told.
        del kept
        return True

    def __repr__(self) -> str:
        state = "held" if self._reason is None else f"settled ({self._reason})"
        return f"<Hold {self.what} {state}>"


def _call(callback: Callable[[Hold], object], hold: Hold) -> None:
    try:
        callback(hold)
    except Exception:
        _log.exception("a callback of %r raised", hold)


@final
class HeldLedger:
    """The holds of one owner: how many there are and how many bytes they hold.

    Each hold is logged once, as a warning, when it is taken, and leaves the count when it
    settles (from any thread). Not a checkpoint anywhere.

    :param owner: who holds, for the log line (``"encoder"``, ``"landing pool"``…).
    """

    __slots__ = ("_holds", "_lock", "held_bytes", "owner", "taken")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        # Guarded by _lock.
        self._holds: set[Hold] = set()
        #: Bytes of the holds not settled yet.
        self.held_bytes = 0
        #: Holds taken in all (settled ones included).
        self.taken = 0

    def __len__(self) -> int:
        return len(self._holds)

    def add(self, hold: Hold) -> None:
        """Count ``hold`` until it settles (once: adding it again changes nothing)."""
        with self._lock:
            if hold in self._holds or hold.settled:
                return
            self._holds.add(hold)
            self.held_bytes += hold.nbytes
            self.taken += 1
        _log.warning(
            "%s: %s is held: a transfer may still touch it; it is kept out of use until "
            "that transfer is known to have ended",
            self.owner,
            hold.what,
        )
        hold.on_settled(self._settled)

    def holds(self) -> tuple[Hold, ...]:
        """The holds not settled yet."""
        with self._lock:
            return tuple(self._holds)

    def _settled(self, hold: Hold) -> None:
        with self._lock:
            if hold in self._holds:
                self._holds.remove(hold)
                self.held_bytes -= hold.nbytes
