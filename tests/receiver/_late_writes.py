"""An encoder's transfer engine whose writes time out with an unknown outcome and land later.

It wraps a real :class:`~encdisagg.transfer.LoopbackEngine`: registrations and ordinary
writes go through. A write chosen to be late raises
:class:`~encdisagg.TransferTimeoutError` carrying a :class:`~encdisagg.transfer.Hold`, as
Mooncake does when it stops waiting for a write that may still fly, and copies nothing yet;
the test makes it land (the copy into the receiver's landing pages) when it wants to, which
settles the hold: from then on the encoder may report the write ended.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from encdisagg import TransferTimeoutError
from encdisagg.transfer import Hold, LoopbackEngine


@dataclass(frozen=True)
class LateWrite:
    target_session: str
    local_ptr: int
    remote_ptr: int
    nbytes: int
    hold: Hold


class LateWriteEngine:
    """``inner``, except that its first ``late_writes`` writes time out and land later.

    :param inner: the real engine (its fabric reaches the receiver's engine).
    :param late_writes: how many writes, from the first, time out instead of copying.
    """

    #: Calls are inline copies, as the inner engine's are.
    blocking = False

    def __init__(self, inner: LoopbackEngine, *, late_writes: int = 1) -> None:
        self.inner = inner
        self._late_left = late_writes
        #: Writes that timed out and have not landed yet.
        self.in_flight: list[LateWrite] = []

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, ptr: int, nbytes: int) -> None:
        self.inner.register(ptr, nbytes)

    def deregister(self, ptr: int) -> None:
        self.inner.deregister(ptr)

    def keep_until_closed(self, keepalive: object, ptr: int | None = None) -> None:
        self.inner.keep_until_closed(keepalive, ptr)

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        if self._late_left == 0:
            self.inner.write(target_session, local_ptr, remote_ptr, nbytes)
            return
        self._late_left -= 1
        hold = Hold(f"a late write of {nbytes} bytes to {target_session}", nbytes)
        self.in_flight.append(LateWrite(target_session, local_ptr, remote_ptr, nbytes, hold))
        raise TransferTimeoutError(
            f"write of {nbytes} bytes to {target_session} timed out; it may still land",
            hold=hold,
        )

    def land(self) -> None:
        """Make every late write land now, then settle its hold (the write ended)."""
        landing, self.in_flight = self.in_flight, []
        for write in landing:
            try:
                self.inner.write(
                    write.target_session, write.local_ptr, write.remote_ptr, write.nbytes
                )
            finally:
                write.hold.settle("the late write landed")

    def end_without_landing(self) -> None:
        """Settle the holds of the writes still in flight, copying nothing."""
        ending, self.in_flight = self.in_flight, []
        for write in ending:
            write.hold.settle("the late write was dropped")


@contextmanager
def ended_on_exit(engine: LateWriteEngine) -> Iterator[LateWriteEngine]:
    """End the writes still in flight when the block ends, also when it fails: an encoder
    waits for a held write before its memory goes, and a failing test must not leave one."""
    try:
        yield engine
    finally:
        engine.end_without_landing()
