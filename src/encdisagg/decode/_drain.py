"""Waiting for drained-acks: the async face of :class:`AbortAckTracker`."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from ._acks import AbortAckTracker

__all__ = ["DrainAcks"]


@dataclass(eq=False, slots=True)
class _Wakeup:
    # One per (room, generation) with waiters; replaced after every wake-up.
    event: anyio.Event = field(default_factory=anyio.Event)
    waiters: int = 0


class DrainAcks:
    """An :class:`AbortAckTracker` whose acks wake the tasks waiting for them.

    :param tracker: the tracker to count in (a new one if omitted); share it with a
        :class:`DecodeTransferQueue` to serve both from one ack stream.

    Every method except :meth:`wait_drained` is synchronous and never checkpoints; call
    :meth:`ack` from the task that receives the prefill ranks' messages.
    """

    def __init__(self, tracker: AbortAckTracker | None = None) -> None:
        self.tracker = tracker if tracker is not None else AbortAckTracker()
        self._wakeups: dict[tuple[int, int], _Wakeup] = {}

    def arm(self, room: int) -> int:
        """Arm ``room`` and return its new generation (see :meth:`AbortAckTracker.arm`)."""
        return self.tracker.arm(room)

    def ack(self, room: int, rank: int, generation: int) -> bool:
        """Record a drained-ack and wake whoever waits on ``(room, generation)``.

        Returns ``False`` if the ack was dropped (room not armed, or not that generation).
        """
        if not self.tracker.ack(room, rank, generation):
            return False
        wakeup = self._wakeups.pop((room, generation), None)
        if wakeup is not None:
            wakeup.event.set()
        return True

    def clear(self, room: int, *, generation: int | None = None) -> None:
        """Forget ``room`` (only if still at ``generation``, when given)."""
        self.tracker.clear(room, generation=generation)

    def waiting(self, room: int, generation: int) -> int:
        """How many tasks wait on ``(room, generation)`` right now."""
        wakeup = self._wakeups.get((room, generation))
        return 0 if wakeup is None else wakeup.waiters

    async def wait_drained(self, room: int, generation: int, required_acks: int) -> None:
        """Wait until ``required_acks`` distinct ranks acked ``generation`` of ``room``.

        A checkpoint, also when the acks are in already. It does not time out by itself:
        if ``room`` is cleared or armed again for another request, acks of ``generation``
        can no longer arrive and only the caller's deadline ends the wait, which is the safe
        outcome (the writes of ``generation`` were never confirmed drained). Cancelling it
        leaves nothing behind.
        """
        await anyio.lowlevel.checkpoint()
        key = (room, generation)
        while not self.tracker.is_release_safe(room, required_acks, generation=generation):
            wakeup = self._wakeups.get(key)
            if wakeup is None:
                wakeup = self._wakeups[key] = _Wakeup()
            wakeup.waiters += 1
            try:
                await wakeup.event.wait()
            finally:
                wakeup.waiters -= 1
                if wakeup.waiters == 0 and self._wakeups.get(key) is wakeup:
                    del self._wakeups[key]
