"""How an abort from decode reaches a prefill request, running or not started yet.

A running request is a :class:`PrefillJob`: an abort cancels its scope while nothing is being
written, and otherwise only raises ``stop``, which the write thread checks between pages (a
write that was started is never abandoned). An abort for a request that has not started here
yet is remembered in :class:`AbortTombstones`, so it is aborted the moment it starts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import anyio

if TYPE_CHECKING:
    from ._messages import KVDestination
    from ._prefill_types import PipelineRequest

__all__ = ["AbortTombstones", "PrefillJob"]

#: Aborts remembered for requests that have not started here yet.
_TOMBSTONES: Final = 10_000


@dataclass(eq=False)
class PrefillJob:
    """One request running on the prefill worker (identity equality)."""

    request: PipelineRequest
    #: Cancelled by an abort while nothing is being written.
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    aborted: bool = False
    #: The generation of decode's abort, once one carried it: ack it after the last write.
    generation: int | None = None
    destination: KVDestination | None = None
    destination_ready: anyio.Event = field(default_factory=anyio.Event)
    #: True while the write thread runs: then an abort only raises ``stop``.
    writing: bool = False
    stop: threading.Event = field(default_factory=threading.Event)

    def abort(self, generation: int | None) -> None:
        """Stop the request: between pages if the write thread runs, else at once.

        ``generation`` (if not ``None``) is the abort's, to be acked once the last write
        returned.
        """
        self.aborted = True
        if generation is not None:
            self.generation = generation
        self.stop.set()
        if not self.writing:
            self.scope.cancel()


class AbortTombstones:
    """Aborts of rooms not running here yet, each with its generation; bounded (the
    oldest are forgotten first)."""

    def __init__(self, limit: int = _TOMBSTONES) -> None:
        self._limit = limit
        self._rooms: OrderedDict[int, int | None] = OrderedDict()

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def remember(self, room: int, generation: int | None) -> None:
        self._rooms[room] = generation
        while len(self._rooms) > self._limit:
            self._rooms.popitem(last=False)

    def pop(self, room: int) -> int | None:
        """Forget the abort of ``room`` (which must be remembered); returns its generation."""
        return self._rooms.pop(room)
