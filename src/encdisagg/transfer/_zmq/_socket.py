"""One PUSH socket of a push pool, and waiting on a ZMQ socket's state from AnyIO.

ZMQ's ``ZMQ_FD`` is edge-triggered and signals *any* state change (readable or writable), so
``ZMQ_EVENTS`` is read before every wait and again after every wake-up.

A PUSH socket whose peer went away reconnects every ``ZMQ_RECONNECT_IVL`` (100 ms) for as
long as it is open. Its monitor (``zmq_socket_monitor``, over an inproc PAIR socket) reports
each refused attempt, so the pool can close such a socket at the first one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final, cast

import anyio
import zmq
from zmq.utils.monitor import parse_monitor_message

from ..._errors import TransferError

__all__ = ["Connection", "wait_events", "wait_room", "watch_refusals"]

#: The monitor events a push socket reports: a connection attempt failed (ZMQ retries it),
#: or one completed.
_MONITORED: Final = zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED


async def wait_events(sock: zmq.Socket[Any], fd: int, event: int) -> None:
    """Return once ``sock``'s ``ZMQ_EVENTS`` has ``event``; checkpoints only if it waits.

    :raises anyio.ClosedResourceError: if the socket is closed (``notify_closing``) meanwhile.
    """
    while not cast(int, sock.getsockopt(zmq.EVENTS)) & event:
        await anyio.wait_readable(fd)


async def wait_room(connection: Connection) -> None:
    """Return once the socket takes a message; checkpoints only if it waits."""
    # Marked for the whole wait: nothing else runs between its checks and its awaits.
    connection.parked = True
    try:
        await wait_events(connection.socket, connection.fd, zmq.POLLOUT)
    finally:
        connection.parked = False


@dataclasses.dataclass(eq=False)
class Connection:
    """One PUSH socket to one endpoint, and what its sends need to know of it."""

    url: str
    socket: zmq.Socket[Any]
    fd: int
    # Held by the one send that may wait for room (sends queue for it, one after another).
    # Fast acquire: taking it free costs no pass through the event loop (the send's own
    # cancellation point comes before it, its scheduling point after), so a send that finds
    # room queues its message at once instead of yielding while other sends pile up behind
    # the lock.
    lock: anyio.Lock = dataclasses.field(default_factory=lambda: anyio.Lock(fast_acquire=True))
    # Set while that send is parked on the socket's descriptor. ZMQ's descriptor is edge
    # triggered: reading ZMQ_EVENTS (as send_nowait does) would swallow the wake-up the
    # parked send waits for, so send_nowait leaves the socket alone meanwhile.
    parked: bool = False
    # Set once the socket was closed (break_off); any message still queued on it then was
    # dropped.
    broken: bool = False
    # Sends between their connect and ZMQ's release of their payload (busy while any).
    users: int = 0
    # Set by every message queued; the idle sweep clears it, and closes a socket it finds
    # cleared (nothing queued for a whole sweep period) and not busy.
    used: bool = True
    # The trackers of zero-copy payloads queued here whose sends still wait for the release.
    held: set[zmq.MessageTracker] = dataclasses.field(default_factory=set)
    # Those of them ZMQ had not released yet when the socket was closed: their messages were
    # dropped with the queue. A payload released before the close had left whole (ZMQ lets
    # go of a frame once it is written to the kernel), so its send did not fail.
    dropped: frozenset[zmq.MessageTracker] = frozenset()
    # The socket's monitor (see watch_refusals) and its descriptor, if it is watched.
    monitor: zmq.Socket[Any] | None = None
    monitor_fd: int = -1
    # Set by a refused connection attempt, cleared by a completed connection.
    refused: bool = False
    # When the first refusal since the last completed connection (or since connecting)
    # came, on the event loop's clock; None while not refused.
    refused_since: float | None = None
    # The grace after which the pool gave up on the endpoint because it kept refusing:
    # the sends that waited on the socket then fail instead of connecting afresh.
    gave_up_after_s: float | None = None

    def watch(self) -> None:
        """Start the socket's monitor (for :func:`watch_refusals`). Not a checkpoint."""
        self.monitor = self.socket.get_monitor_socket(_MONITORED)
        self.monitor_fd = cast(int, self.monitor.getsockopt(zmq.FD))

    def break_off(self) -> None:
        """Close the socket with linger 0 (ZMQ drops its queue), and its monitor;
        idempotent. Not a checkpoint. A send waiting for room on it is woken (and sees
        ``broken``), and so is its monitor's watcher."""
        if self.broken:
            return
        self.broken = True
        self.dropped = frozenset(tracker for tracker in self.held if not tracker.done)
        anyio.notify_closing(self.fd)
        self.socket.close(linger=0)
        if self.monitor is not None:
            anyio.notify_closing(self.monitor_fd)
            self.monitor.close(linger=0)

    def connected(self) -> None:
        """A connection completed: the endpoint is not refusing. Not a checkpoint."""
        self.refused = False
        self.refused_since = None

    def give_up(self, grace_s: float | None) -> bool:
        """Whether the endpoint has refused every attempt for ``grace_s`` (never, if
        ``None``); if so the sends waiting on it are to fail. Not a checkpoint."""
        since = self.refused_since
        if grace_s is None or since is None or anyio.current_time() - since < grace_s:
            return False
        self.gave_up_after_s = grace_s
        return True

    def raise_if_given_up(self, what: str) -> None:
        """:raises TransferError: the pool gave up on the endpoint (see :meth:`give_up`)."""
        if self.gave_up_after_s is not None:
            raise TransferError(
                f"{what} failed: the endpoint refused every connection attempt for "
                f"{self.gave_up_after_s} s (nothing listens there)"
            )

    @property
    def idle(self) -> bool:
        """No send uses the socket and nothing was queued on it since the last sweep."""
        return self.users == 0 and not self.used and not self.lock.locked()


async def watch_refusals(connection: Connection, on_refused: Callable[[Connection], None]) -> None:
    """Follow ``connection``'s monitor until the socket is closed: each refused (or
    otherwise failed) connection attempt sets ``refused`` and calls ``on_refused``; a
    completed connection clears it. Start :meth:`Connection.watch` first.

    A checkpoint; returns once the connection was broken off. Cancelled, it leaves the
    monitor open (``break_off`` closes it).
    """
    monitor, fd = connection.monitor, connection.monitor_fd
    assert monitor is not None
    try:
        while not connection.broken:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await wait_events(monitor, fd, zmq.POLLIN)
                continue
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_CONNECTED:
                connection.connected()
            elif event == zmq.EVENT_CONNECT_RETRIED:
                connection.refused = True
                if connection.refused_since is None:
                    connection.refused_since = anyio.current_time()
                on_refused(connection)
    except (anyio.ClosedResourceError, zmq.ZMQError):
        pass  # closed under it (a ZMQError: closed between two of its calls)
