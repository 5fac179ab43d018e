"""Turns at reading request bodies, so that Trio's event loop keeps answering probes.

Trio runs every task that is ready in one batch before it looks at the network again, and
a connection receiving a large body is ready again as soon as one read returned: its
socket holds more. Under 200 concurrent 1.9 MiB uploads, Hypercorn's Trio worker thus had
about a hundred connection tasks in each batch (one 64 KiB read, HTTP/1.1 parsing and
Quart's body buffer each), 30 to 300 ms a batch, and each step of a ``/health`` request
waited for a whole batch. All 200 bodies also finished together, at the end of the
upload, so no encode could start before then.

Here a connection whose last read filled Hypercorn's receive size (64 KiB) is streaming a
body. Before its next read (of up to 256 KiB) it waits, holding nothing, until its socket
is readable, then takes one of a few turns; the oldest streams go first. A batch then
holds at most a few reads however many uploads are open; bodies arrive one after another
(their encodes start early), and a connection that has sent nothing yet (a probe, a new
request) never waits for a turn. A client that stops sending mid-body holds no turn while
it is silent.

asyncio's Hypercorn worker reads in the transport's callbacks, and is left as it is.
"""

from __future__ import annotations

import heapq
import itertools
import os
import weakref
from dataclasses import dataclass, field
from math import inf
from typing import Final

import anyio
import anyio.lowlevel
import hypercorn.trio.run
import hypercorn.trio.tcp_server
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData

from ..._errors import BadRequestError
from ..._numbers import whole
from ._eof_close import _TrioTCPServer

__all__ = [
    "DEFAULT_READ_TURNS",
    "READ_TURNS_ENV",
    "STREAM_RECEIVE_BYTES",
    "ReadTurns",
    "install_read_turns",
    "read_turns_from_env",
]

#: Streaming connections that may read at once in one Trio server.
DEFAULT_READ_TURNS: Final = 4
#: What one read of a stream may take: asyncio's transports read 256 KiB at a time too.
#: Every read lets go of the GIL, and while worker threads decode and preprocess, taking it
#: back costs the event loop up to a switch interval (5 ms): a quarter of the reads per
#: body is a quarter of those waits.
STREAM_RECEIVE_BYTES: Final = 256 * 1024
#: The environment variable that sets the number of turns; ``0`` keeps Hypercorn's own
#: read loop (every connection reads whenever its socket has data).
READ_TURNS_ENV: Final = "ENCDISAGG_TRIO_READ_TURNS"


@dataclass(order=True)
class _Waiter:
    age: int
    ticket: int
    event: anyio.Event = field(compare=False)
    granted: bool = field(default=False, compare=False)
    left: bool = field(default=False, compare=False)


class ReadTurns:
    """A fixed number of turns, handed to waiters oldest ``age`` first.

    :raises BadRequestError: if ``turns`` is not a positive integer.
    """

    def __init__(self, turns: int) -> None:
        self.turns = whole("read turns", turns, least=1, error=BadRequestError)
        self._free = turns
        self._waiting: list[_Waiter] = []
        self._ages = itertools.count()
        self._tickets = itertools.count()

    def next_age(self) -> int:
        """A new stream's age: later streams are younger. Not async."""
        return next(self._ages)

    @property
    def free(self) -> int:
        """Turns nobody holds now."""
        return self._free

    @property
    def waiting(self) -> int:
        """Tasks waiting for a turn now."""
        return sum(not waiter.left for waiter in self._waiting)

    async def take(self, age: int) -> None:
        """Take a turn; give it back with :meth:`give_back`.

        A checkpoint only when it waits (a free turn, nobody waiting: returns at once, so
        the read that follows costs no extra pass of the event loop). Cancelled while
        waiting, it holds no turn; a turn handed to it at that moment goes to the next.
        """
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        waiter = _Waiter(age, next(self._tickets), anyio.Event())
        heapq.heappush(self._waiting, waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            waiter.left = True
            if waiter.granted:
                self.give_back()
            raise

    def give_back(self) -> None:
        """Hand a turn to the oldest waiter, or free it. Not async."""
        while self._waiting:
            waiter = heapq.heappop(self._waiting)
            if not waiter.left:
                waiter.granted = True
                waiter.event.set()
                return
        self._free += 1


#: Each server's turns, by the Hypercorn config it was started with.
_TURNS: weakref.WeakKeyDictionary[HypercornConfig, ReadTurns] = weakref.WeakKeyDictionary()


class _TurnTakingTCPServer(_TrioTCPServer):
    """Hypercorn's Trio connection, reading body streams in turns (when its server has
    turns; otherwise Hypercorn's own loop)."""

    async def _read_data(self) -> None:
        turns = _TURNS.get(self.config)
        # Not over TLS: its stream has no socket of its own to wait on.
        socket = getattr(self.stream, "socket", None)
        if turns is None or socket is None:
            await super()._read_data()
            return
        size = hypercorn.trio.tcp_server.MAX_RECV
        stream_age: int | None = None
        while True:
            try:
                with trio.fail_after(self.config.read_timeout or inf):
                    if stream_age is None:
                        data = await self.stream.receive_some(size)
                    else:
                        # Wait for data before taking a turn: a silent client holds none.
                        await trio.lowlevel.wait_readable(socket)
                        await turns.take(stream_age)
                        try:
                            data = await self.stream.receive_some(STREAM_RECEIVE_BYTES)
                        finally:
                            turns.give_back()
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            if len(data) < size:
                stream_age = None
            elif stream_age is None:
                stream_age = turns.next_age()
            await self.protocol.handle(RawData(bytes(data)))
            if not data:
                break
        await self.protocol.handle(Closed())
        # As _eof_close does after Hypercorn's loop: no keep-alive left to wait for.
        await self.idle_task.stop()


def read_turns_from_env() -> int:
    """The number of turns from ``ENCDISAGG_TRIO_READ_TURNS`` (default 4; 0: off). Not
    async.

    :raises BadRequestError: if the variable is not a non-negative integer.
    """
    text = os.environ.get(READ_TURNS_ENV, "").strip()
    if not text:
        return DEFAULT_READ_TURNS
    try:
        turns = int(text)
    except ValueError:
        turns = -1
    if turns < 0:
        raise BadRequestError(f"{READ_TURNS_ENV} must be an integer >= 0; got {text!r}")
    return turns


def install_read_turns(config: HypercornConfig, turns: int) -> None:
    """Make the Trio server started with ``config`` read body streams in ``turns`` turns
    (``0``: Hypercorn's own loop). Not async. Call after ``install_eof_close``, whose fix
    the connections keep."""
    hypercorn.trio.run.TCPServer = _TurnTakingTCPServer  # type: ignore[attr-defined]
    if turns > 0:
        _TURNS[config] = ReadTurns(turns)
    else:
        _TURNS.pop(config, None)
