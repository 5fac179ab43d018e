"""Waiting for drained-acks: the async face of :class:`AbortAckTracker`."""

from __future__ import annotations

import anyio.lowlevel

from ..nurseries import KeyedWakeups
from ._acks import AbortAckTracker

__all__ = ["DrainAcks"]


class DrainAcks:
    """An :class:`AbortAckTracker` whose acks wake the tasks waiting for them.

    :param tracker: the tracker to count in (a new one if omitted); share it with a
        :class:`DecodeTransferQueue` to serve both from one ack stream.

    Every method except :meth:`wait_drained` is synchronous and never checkpoints; call
    :meth:`ack` from the task that receives the prefill ranks' messages.
    """

    def __init__(self, tracker: AbortAckTracker | None = None) -> None:
        self.tracker = tracker if tracker is not None else AbortAckTracker()
        self._parked: KeyedWakeups[tuple[int, int]] = KeyedWakeups()

    def arm(self, room: int) -> int:
        """Arm ``room`` and return its new generation (see :meth:`AbortAckTracker.arm`)."""
        return self.tracker.arm(room)

    def ack(self, room: int, rank: int, generation: int) -> bool:
        """Record a drained-ack and wake whoever waits on ``(room, generation)``.

        Returns ``False`` if the ack was dropped (room not armed, or not that generation).
        """
        if not self.tracker.ack(room, rank, generation):
            return False
        self._parked.wake((room, generation))
        return True

    def clear(self, room: int, *, generation: int | None = None) -> None:
        """Forget ``room`` (only if still at ``generation``, when given)."""
        self.tracker.clear(room, generation=generation)

    def waiting(self, room: int, generation: int) -> int:
        """How many tasks wait on ``(room, generation)`` right now."""
        return self._parked.waiting((room, generation))

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
            await self._parked.park(key)
