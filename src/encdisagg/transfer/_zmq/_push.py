"""Embedding push and pull over ZMQ, native to AnyIO (asyncio and Trio alike).

``zmq.asyncio`` only works on asyncio, so the sockets here are plain non-blocking ZMQ
sockets whose ``ZMQ_FD`` is awaited with :func:`anyio.wait_readable` (``_socket``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, cast, final

import anyio
import anyio.abc
import anyio.lowlevel
import zmq

from ..._errors import TransferError
from ..._numbers import real, whole
from ...nurseries import ThreadSafeEvent, collapse_single_error, run_thread_to_completion
from .._holds import Hold
from .._wire import EmbeddingHeader, ForeignHeader, header_frame
from ._curve import CurveClient
from ._release import send_signalled, wait_released
from ._socket import Connection, wait_room, watch_refusals

__all__ = ["ZmqPushPool"]

# Below this size a payload is copied into ZMQ's own message rather than tracked. Measured on
# loopback: a tracked send costs ~0.25 ms whatever its size (ZMQ's release passes through
# three threads), a copied one of 64 KiB ~0.06 ms; but the copy runs on the event loop
# (~25 us at 64 KiB, ~0.1 ms at 256 KiB, ~0.4 ms at 1 MiB), and so would block it longer.
DEFAULT_COPY_BELOW_BYTES: Final = 64 * 1024
# How many tracked sends of one pool may wait for their release in worker threads at once;
# further ones queue for a thread. Private, so that a slow receiver never takes the threads
# of AnyIO's default limiter from model forwards and engine calls.
_RELEASE_WAITER_THREADS: Final = 64
# What a copied frame is tracked by: ZMQ never held the caller's memory.
_NOTHING_HELD: Final = zmq.MessageTracker()
#: A socket no send used for this long is closed (its receiver may be gone for good: ZMQ
#: would otherwise try to reconnect to it forever).
DEFAULT_IDLE_TIMEOUT_S: Final = 60.0
#: Sockets a pool keeps open; a new endpoint beyond it closes the least recently used idle one.
DEFAULT_MAX_ENDPOINTS: Final = 128
#: How long a send waits on an endpoint that refuses every connection attempt.
DEFAULT_REFUSED_GRACE_S: Final = 2.0


@final
class ZmqPushPool(anyio.AsyncContextManagerMixin):
    """Pushes embedding messages (DESIGN §5.2) to PULL endpoints.

    Payloads of ``copy_below_bytes`` or more go out zero-copy: ZMQ reads the caller's memory
    while it sends, and :meth:`send` waits until it let go. Smaller payloads, headers and
    error parts are copied into ZMQ's own messages as they are queued.

    One persistent PUSH socket per endpoint URL, connected on first use. Use it as ``async
    with ZmqPushPool() as pool:``; leaving the block (or :meth:`aclose`) closes every socket.

    :param send_timeout_s: the bound on one :meth:`send`, from its call until ZMQ released
        the payload.
    :param context: a plain (blocking) ``zmq.Context`` to create sockets in (not a
        ``zmq.asyncio`` one); a private one, terminated on close, if omitted.
    :param sndhwm: how many messages may be queued per endpoint before further sends wait.
    :param release_timeout_s: how long a failed, cancelled or aborted send waits (shielded)
        for ZMQ to let go of its payload after dropping it. ZMQ drops it within
        milliseconds; the bound only keeps a broken ZMQ from hanging the caller.
    :param copy_below_bytes: payloads smaller than this are copied rather than sent
        zero-copy; 0 sends every payload zero-copy.
    :param immediate: queue messages only on a completed connection (ZMQ's
        ``ZMQ_IMMEDIATE``). On (the default), a send to an endpoint nobody listens at waits
        for room and fails after ``send_timeout_s``; off, a copied message to it is queued
        and counts as sent although it may never leave.
    :param idle_timeout_s: inside ``async with``, a socket no send used for this long is
        closed within another ``idle_timeout_s`` (a copied message that waited in its queue
        all that time is dropped); the next send to it connects afresh. With ``immediate``
        on, a socket whose peer refuses a connection (a receiver that went away) is closed
        at once instead, unless sends are using it (then as soon as the last one is done,
        unless a connection completed meanwhile).
    :param refused_grace_s: with ``immediate`` on (inside ``async with``), a send waiting on
        an endpoint that has refused every connection attempt for this long fails then
        (:class:`~encdisagg.TransferError`) instead of waiting out ``send_timeout_s``: a
        receiver that went away is found within about this bound. A receiver that binds
        within it still gets the message. ``None`` waits the whole send timeout.
    :param max_endpoints: how many sockets the pool keeps: connecting to one more endpoint
        first closes the least recently used socket no send is using. Only while every
        socket is in use does the pool grow past it.
    :param curve_server_key: the receivers' CURVE public key (Z85): every push is then
        encrypted and authenticated, and reaches only a receiver holding its secret key.
    :param curve_server_keys: per-URL receiver keys, winning over ``curve_server_key``.
        With CURVE on, a push to a URL without a key fails: nothing goes out in the clear.
    """

    def __init__(
        self,
        *,
        send_timeout_s: float = 30.0,
        context: zmq.Context[Any] | None = None,
        sndhwm: int = 16,
        release_timeout_s: float = 5.0,
        copy_below_bytes: int = DEFAULT_COPY_BELOW_BYTES,
        immediate: bool = True,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_endpoints: int = DEFAULT_MAX_ENDPOINTS,
        curve_server_key: str | bytes | None = None,
        curve_server_keys: Mapping[str, str | bytes] | None = None,
        refused_grace_s: float | None = DEFAULT_REFUSED_GRACE_S,
    ) -> None:
        real("send_timeout_s", send_timeout_s, above=0, finite=False)
        whole("sndhwm", sndhwm, least=1)
        whole("copy_below_bytes", copy_below_bytes)
        real("idle_timeout_s", idle_timeout_s, above=0, finite=False)
        whole("max_endpoints", max_endpoints, least=1)
        if refused_grace_s is not None:
            real("refused_grace_s", refused_grace_s, least=0, finite=False)
        self._refused_grace_s = refused_grace_s
        self._curve = CurveClient.create(curve_server_key, curve_server_keys)
        self._idle_timeout_s = idle_timeout_s
        self._max_endpoints = max_endpoints
        self._send_timeout_s = send_timeout_s
        self._sndhwm = sndhwm
        self._release_timeout_s = release_timeout_s
        self._copy_below_bytes = copy_below_bytes
        self._immediate = immediate
        self._release_waiters = anyio.CapacityLimiter(_RELEASE_WAITER_THREADS)
        self._context = context
        self._owns_context = context is None
        self._closed = False
        #: The loop's call-soon while entered (looked up once); None: each send looks it up.
        self._schedule: Callable[[Callable[[], object]], object] | None = None
        # The current (not broken) connection of each endpoint.
        self._connections: dict[str, Connection] = {}
        # One scope per running send, cancelled by aclose(); _sends_done is set by the last
        # send to finish once aclose() waits for them.
        self._running_sends: set[anyio.CancelScope] = set()
        self._sends_done: anyio.Event | None = None
        #: Inside ``async with``: where each socket's monitor is watched (``immediate`` only).
        self._watchers: anyio.abc.TaskGroup | None = None

    @property
    def endpoints(self) -> frozenset[str]:
        """The URLs this pool holds a connected socket for."""
        return frozenset(self._connections)

    async def send(
        self,
        url: str,
        header: EmbeddingHeader | ForeignHeader,
        payload: memoryview | None,
        *,
        on_still_held: Callable[[Hold], None] | None = None,
    ) -> None:
        """Push ``[header, payload]`` to ``url``; return once ZMQ no longer holds ``payload``.

        ``header`` is our msgpack header (DESIGN §5.2), checked against ``payload``, or a
        :class:`ForeignHeader` (SGLang's), sent as given.

        ``payload`` (the C-contiguous embedding bytes, e.g. from
        :func:`~encdisagg.transfer.payload_view`) is sent without copying if it has at least
        ``copy_below_bytes``: the call then returns once ZMQ handed the whole message to the
        kernel's TCP buffer. A smaller payload is copied into ZMQ's queue, and the call returns
        as soon as it is queued. An error part (``header.error`` set) has no payload and is
        queued the same way. Either way the caller may reuse or free the memory right away on
        return. ZMQ PUSH has no acknowledgments: a peer that disconnects mid-message loses it
        silently, and so does one whose connection is reset (see below) while a copied message
        still waits in the queue, so a receiver must bound its own wait.

        Concurrent sends to one URL queue their messages whole, one after another (frames
        never interleave); up to ``sndhwm`` messages wait in ZMQ's queue at once, the
        others wait for room. This is a checkpoint.

        The wait for a zero-copy payload's release does not poll: the payload view's finalizer
        wakes it when ZMQ lets go (one worker thread waits on ZMQ's tracker only for a release
        still pending after a second; ``_release``). If ZMQ still holds the payload when the
        call gives up (``send_timeout_s`` ran out, the caller was cancelled, or the pool
        closed), the endpoint's socket is closed with linger 0 and evicted: ZMQ drops everything
        queued on it, including other sends' messages, which then fail too (a send whose
        payload ZMQ had let go of before the close, its message written whole, succeeds).
        This call then waits (shielded, bounded by ``release_timeout_s``) until ZMQ let go of
        the payload, and only then raises. A call that gives up while its message still waits
        for room leaves the socket alone: nothing of it reached ZMQ, and the messages queued
        ahead fare on their own. The next send to an evicted URL connects afresh.

        Should ZMQ still reference the payload even then (it never did so in any test: ZMQ lets
        go within milliseconds of the close), ``on_still_held(hold)`` is called before the
        call raises, with a :class:`~encdisagg.transfer.Hold` on the payload that settles
        once ZMQ lets go of it: the caller keeps that memory out of reuse until then.

        A timeout raises :class:`~encdisagg.TransferError` (502), not
        :class:`~encdisagg.RequestTimeoutError`: a peer that does not take the message is a
        failed transfer, not a slow local wait.

        :raises BadRequestError: if ``payload`` does not match ``header`` (missing, present
            for an error part, not contiguous, or a size other than ``payload_nbytes``).
        :raises TransferError: on timeout, on a ZMQ error, if the connection was reset
            while the message was queued, or if the pool is (or gets) closed.
        """
        head = header_frame(header, payload)
        what = f"ZMQ send of req_id {header.req_id!r} part {header.part_idx} to {url}"
        if self._closed:
            raise TransferError(f"{what}: the push pool is closed", req_id=header.req_id)
        # One scope for both ends of a send: its deadline, and aclose() cancelling it.
        scope = anyio.CancelScope(deadline=anyio.current_time() + self._send_timeout_s)
        self._running_sends.add(scope)
        try:
            with scope:
                await self._send(url, head, payload, what, on_still_held)
        except TransferError as exc:
            exc.req_id = header.req_id
            raise
        finally:
            self._running_sends.discard(scope)
            if not self._running_sends and self._sends_done is not None:
                self._sends_done.set()
        if scope.cancelled_caught:
            if anyio.current_time() >= scope.deadline:
                raise TransferError(
                    f"{what} timed out after {self._send_timeout_s} s", req_id=header.req_id
                )
            raise TransferError(f"{what}: aborted, the push pool closed", req_id=header.req_id)

    def send_nowait(
        self, url: str, header: EmbeddingHeader | ForeignHeader, payload: memoryview | None
    ) -> bool:
        """Queue ``[header, payload]`` for ``url`` now if that needs no wait; whether it did.

        Not a checkpoint. Only a message ZMQ copies (an error part, or a payload under
        ``copy_below_bytes``) to an endpoint already connected, with room in its queue and no
        send parked waiting for room, is queued here; the caller's memory is free on
        return. It may overtake sends waiting their turn (frames never interleave: both of
        a message's frames are queued in one step). In every other case nothing is queued
        and False is returned: :meth:`send` it then.

        :raises BadRequestError: as :meth:`send`.
        :raises TransferError: ZMQ failed after the header frame (the socket is evicted).
        """
        if payload is not None and payload.nbytes >= self._copy_below_bytes:
            return False
        connection = self._connections.get(url)
        if (
            self._closed
            or connection is None
            or connection.broken
            or connection.parked
            or not cast(int, connection.socket.getsockopt(zmq.EVENTS)) & zmq.POLLOUT
        ):
            return False
        head = header_frame(header, payload)
        what = f"ZMQ send of req_id {header.req_id!r} part {header.part_idx} to {url}"
        connection.used = True
        try:
            return self._queue(connection, head, payload, what) is not None
        except TransferError as exc:
            exc.req_id = header.req_id
            raise

    async def aclose(self) -> None:
        """Abort running sends, close every socket and (if private) the ZMQ context.

        Idempotent. Shielded: it completes even when cancelled; every wait in it is
        bounded. Aborted sends raise :class:`~encdisagg.TransferError` in their own tasks,
        each after ZMQ released its payload.
        """
        self._closed = True
        self._schedule = None
        with anyio.CancelScope(shield=True):
            if self._running_sends:
                self._sends_done = anyio.Event()
                for scope in self._running_sends:
                    scope.cancel()
                with anyio.move_on_after(self._release_timeout_s + 1.0):
                    await self._sends_done.wait()
            for connection in list(self._connections.values()):
                self._evict(connection)
            if self._owns_context and self._context is not None:
                context, self._context = self._context, None
                # Every socket is closed by now; destroy() would close stragglers rather
                # than block forever, as term() would.
                await run_thread_to_completion(context.destroy, 0)

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[ZmqPushPool]:
        """Entering starts the idle sweep (not a checkpoint); exiting is :meth:`aclose`."""
        self._schedule = ThreadSafeEvent.loop_scheduler()
        try:
            with collapse_single_error():
                async with anyio.create_task_group() as sweeper:
                    sweeper.start_soon(self._close_idle_connections)
                    if self._immediate:
                        # Nothing is queued without a completed connection: a socket whose
                        # peer refuses holds nothing, and is closed at once.
                        self._watchers = sweeper
                    try:
                        yield self
                    finally:
                        self._watchers = None
                        sweeper.cancel_scope.cancel()
        finally:
            await self.aclose()

    async def _close_idle_connections(self) -> None:
        # A timer, not a poll: one wake-up per idle_timeout_s, ended by the pool's exit.
        never = anyio.Event()
        while True:
            with anyio.move_on_after(self._idle_timeout_s):
                await never.wait()
            self.close_idle()

    def close_idle(self) -> int:
        """Close every socket nothing was queued on since the last call and no send uses.

        Not a checkpoint; returns how many it closed. Inside ``async with`` the pool calls
        it every ``idle_timeout_s``.
        """
        closed = 0
        for connection in list(self._connections.values()):
            if connection.used:
                connection.used = False
            elif connection.idle:
                self._evict(connection)
                closed += 1
        return closed

    async def _send(
        self,
        url: str,
        head: bytes,
        payload: memoryview | None,
        what: str,
        on_still_held: Callable[[Hold], None] | None,
    ) -> None:
        # A cancellation point now; the scheduling point is the release wait below (or,
        # when there is nothing to wait for, the shielded checkpoint at the end).
        await anyio.lowlevel.checkpoint_if_cancelled()
        tracker: zmq.MessageTracker | None = None
        while tracker is None:
            connection = self._connect(url, what)
            connection.users += 1
            try:
                async with connection.lock:
                    while tracker is None and not connection.broken:
                        await wait_room(connection)
                        tracker = self._queue(connection, head, payload, what)
                    if tracker is None:
                        connection.raise_if_given_up(what)
            except anyio.ClosedResourceError:
                # The socket was evicted while this send waited for room (another send's
                # failure, or the endpoint kept refusing); nothing of this message was
                # queued: retry on a fresh socket, unless the endpoint was given up on.
                connection.raise_if_given_up(what)
                continue
            except zmq.ZMQError as exc:
                self._evict(connection)
                raise TransferError(f"{what} failed: {exc}") from exc
            finally:
                if tracker is None:
                    self._done_with(connection)
        connection.used = True
        if self._immediate:
            # Queued with ZMQ_IMMEDIATE: a connection was complete. The monitor may still
            # report a refusal from before it after its "connected" (seen under load): that
            # must not evict a socket that works.
            connection.connected()
        released_at_once = tracker.done
        if not released_at_once:
            connection.held.add(tracker)
        try:
            # A send that gives up (timed out, cancelled, aborted) while ZMQ holds the payload
            # drops the connection: ZMQ cannot unqueue one message, but closing the socket
            # with linger 0 drops its queue, after which ZMQ lets go of the buffer.
            await wait_released(
                tracker,
                what,
                drop=lambda: self._evict(connection),
                drop_bound_s=self._release_timeout_s,
                # Past any deadline of the send: the send gives up (and evicts) before it.
                thread_bound_s=self._send_timeout_s + self._release_timeout_s + 1.0,
                limiter=self._release_waiters,
                on_still_held=on_still_held,
                held_bytes=0 if payload is None else payload.nbytes,
            )
            if tracker in connection.dropped:
                raise TransferError(
                    f"{what} failed: the connection was reset while the message was queued "
                    "(another send to this endpoint failed)"
                )
        finally:
            connection.held.discard(tracker)
            self._done_with(connection)
        if released_at_once:
            await anyio.lowlevel.cancel_shielded_checkpoint()

    def _queue(
        self, connection: Connection, head: bytes, payload: memoryview | None, what: str
    ) -> zmq.MessageTracker | None:
        """Queue the message; the payload's tracker, or None if ZMQ refused the first frame.

        The header, an error part and a payload under ``copy_below_bytes`` are copied;
        their tracker is one that is done already.
        """
        sock = connection.socket
        try:
            if payload is None:
                sock.send(head, zmq.NOBLOCK)
                return _NOTHING_HELD
            sock.send(head, zmq.NOBLOCK | zmq.SNDMORE)
        except zmq.Again:
            return None
        try:
            # Once the first frame is in, ZMQ takes the rest of the message regardless of
            # the high-water mark.
            if payload.nbytes < self._copy_below_bytes:
                sock.send(payload, zmq.NOBLOCK, copy=True)
                return _NOTHING_HELD
            return send_signalled(sock, payload, zmq.NOBLOCK, self._schedule)
        except zmq.ZMQError as exc:
            # Half a message may sit in the queue: the socket can never be used again.
            self._evict(connection)
            raise TransferError(f"{what} failed after its header frame: {exc}") from exc

    def _connect(self, url: str, what: str) -> Connection:
        connection = self._connections.get(url)
        if connection is not None:
            return connection
        if self._closed:
            raise TransferError(f"{what}: the push pool is closed")
        server_key = None if self._curve is None else self._curve.server_key_for(url)
        if self._curve is not None and server_key is None:
            raise TransferError(f"{what}: no CURVE key is configured for {url}")
        if len(self._connections) >= self._max_endpoints:
            self._make_room()
        if self._context is None:
            self._context = zmq.Context()
        sock = self._context.socket(zmq.PUSH)
        try:
            if self._curve is not None and server_key is not None:
                self._curve.secure(sock, server_key)
            # Linger 0: a message still queued at close is dropped, never waited for. By
            # then its send has either seen the payload handed over or is failing anyway.
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            # Queue only on a completed connection: a send to an endpoint nobody listens
            # at waits for room and times out, instead of a copied message "succeeding"
            # into a queue that never drains.
            sock.setsockopt(zmq.IMMEDIATE, 1 if self._immediate else 0)
            # Track every frame sent with copy=False, however small: which ones are copied
            # is decided by copy_below_bytes alone.
            sock.copy_threshold = 0
            sock.connect(url)
            fd = cast(int, sock.getsockopt(zmq.FD))
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransferError(f"{what}: cannot connect: {exc}") from exc
        connection = Connection(url, sock, fd)
        self._connections[url] = connection
        if self._watchers is not None:
            connection.watch()
            self._watchers.start_soon(watch_refusals, connection, self._refused)
        return connection

    def _refused(self, connection: Connection) -> None:
        # Its peer refused a connection (went away, or never listened): ZMQ would retry
        # every 100 ms until the idle sweep. Unused, the socket goes now; else after its
        # last send (_done_with), or once it has refused for the whole grace (with
        # ZMQ_IMMEDIATE nothing was queued on it: its waiting sends lose only their wait).
        if (connection.users == 0 and not connection.lock.locked()) or connection.give_up(
            self._refused_grace_s
        ):
            self._evict(connection)

    def _done_with(self, connection: Connection) -> None:
        connection.users -= 1
        if connection.refused:
            self._refused(connection)

    def _make_room(self) -> None:
        # Close the least recently used socket no send uses (one idle for a sweep first).
        candidates = [c for c in self._connections.values() if c.idle]
        if not candidates:
            candidates = [c for c in self._connections.values() if c.users == 0]
        if candidates:
            # Dicts keep insertion order: the first connected goes first.
            self._evict(next((c for c in candidates if not c.used), candidates[0]))

    def _evict(self, connection: Connection) -> None:
        if self._connections.get(connection.url) is connection:
            del self._connections[connection.url]
        connection.break_off()
