"""Drained-acks from prefill ranks, counted per room and generation."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

__all__ = ["AbortAckTracker"]


@dataclass(eq=False, slots=True)
class _Drain:
    generation: int
    ranks: set[int] = field(default_factory=set)


class AbortAckTracker:
    """Counts which prefill ranks confirmed that their writes for an aborted room stopped.

    A room (the bootstrap room of a request) is *armed* before the decode side tells the
    prefill ranks to abort; arming starts a fresh count and returns a new *generation*. The
    abort message carries the generation and every rank echoes it in its drained-ack, so an
    ack is credited only to the lifetime of the room it was meant for:

    - acks for a room that is not armed are dropped (they would otherwise be waiting there
      for the next request that reuses the room);
    - acks carrying an older generation are dropped (a late ack from an earlier request of a
      reused room must not release the new one while its own writes may still land);
    - one rank acking twice counts once.

    Generations come from one counter per tracker, so they are never reused, not even for a
    room that was cleared and armed again.

    Every method is synchronous.
    """

    __slots__ = ("_generations", "_rooms")

    def __init__(self) -> None:
        self._rooms: dict[int, _Drain] = {}
        self._generations = itertools.count(1)

    def __contains__(self, room: object) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def arm(self, room: int) -> int:
        """Start a fresh drain count for ``room`` and return its generation.

        Acks recorded for an earlier generation of ``room`` are wiped.
        """
        generation = next(self._generations)
        self._rooms[room] = _Drain(generation)
        return generation

    def generation(self, room: int) -> int | None:
        """The generation ``room`` is armed with, or ``None`` if it is not armed."""
        drain = self._rooms.get(room)
        return None if drain is None else drain.generation

    def acked_ranks(self, room: int) -> frozenset[int]:
        """The ranks that acked the current generation of ``room`` (empty if not armed)."""
        drain = self._rooms.get(room)
        return frozenset() if drain is None else frozenset(drain.ranks)

    def ack(self, room: int, rank: int, generation: int) -> bool:
        """Record that prefill rank ``rank`` drained its writes for ``room``.

        Returns ``False`` (and records nothing) if ``room`` is not armed or ``generation`` is
        not its current generation. A repeated ack from the same rank returns ``True`` but
        counts once.
        """
        drain = self._rooms.get(room)
        if drain is None or drain.generation != generation:
            return False
        drain.ranks.add(rank)
        return True

    def is_release_safe(
        self, room: int, required_acks: int, *, generation: int | None = None
    ) -> bool:
        """Whether at least ``required_acks`` distinct ranks acked the current generation.

        ``False`` for a room that is not armed. With ``generation``, also ``False`` unless the
        room is still armed with that generation: a room re-armed for another request never
        makes an older holder's release look safe.
        """
        drain = self._rooms.get(room)
        if drain is None or (generation is not None and drain.generation != generation):
            return False
        return len(drain.ranks) >= required_acks

    def clear(self, room: int, *, generation: int | None = None) -> None:
        """Forget ``room``; later acks for it are dropped until it is armed again.

        With ``generation``, only if the room is still armed with that generation, so the
        holder of an older generation cannot wipe a newer request's count.
        """
        drain = self._rooms.get(room)
        if drain is not None and (generation is None or drain.generation == generation):
            del self._rooms[room]
