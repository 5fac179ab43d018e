"""The gRPC server beside HTTP (``--grpc-port``): SglangEncoder, health and reflection.

grpc.aio runs only on asyncio, and the server may run on Trio; so on either backend the
gRPC server runs on an asyncio loop of its own, in one thread this module owns, and every
RPC's work is handed to the server's event loop through a blocking portal. One path for
both backends: the work of an RPC always runs in a task group of the server's loop (the
portal's), never on the gRPC thread, and a cancelled RPC (client gone, deadline) cancels
that task and waits for it to stop before the RPC ends.

Lifetime: :class:`GrpcServer` is entered once the Encoder runs and left before it closes.
Leaving stops the gRPC server with a bounded, shielded grace: new RPCs are refused, RPCs
in flight get ``grace_s`` to finish, the rest are cancelled (and their work with them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.from_thread
import anyio.to_thread

from ...nurseries import collapse_single_error
from .._access import ApiKey
from .._asgi._listen import host_port

if TYPE_CHECKING:
    # Imports grpc: only once the grpc extra is known to be installed.
    from ._grpc_service import SglangCalls

__all__ = ["GRPC_EXTRA_HINT", "GrpcServer", "grpc_missing"]

_log = logging.getLogger("encdisagg.server")

#: The install line a missing gRPC stack names.
GRPC_EXTRA_HINT: Final = "pip install 'encdisagg[grpc]'"
#: Seconds between the health Watch stream's looks at readiness.
_WATCH_INTERVAL_S: Final = 0.5
#: Time the gRPC thread gets beyond the grace to wind down before it is given up on.
_STOP_SLACK_S: Final = 10.0


def grpc_missing() -> str | None:
    """Why gRPC cannot be served here (a package of the ``grpc`` extra is missing), or
    ``None``. Not async."""
    missing = []
    for module in ("grpc", "grpc_health.v1", "grpc_reflection.v1alpha", "smg_grpc_proto"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module.partition(".")[0])
    if not missing:
        return None
    return f"--grpc-port needs the grpc extra ({', '.join(missing)} missing): {GRPC_EXTRA_HINT}"


class _Health:
    """``grpc.health.v1.Health``: SERVING while ``ready()`` says so, for the whole server
    (``""``) and for the SglangEncoder service; NOT_FOUND for any other service name."""

    def __init__(self, ready: Callable[[], bool], services: tuple[str, ...]) -> None:
        from grpc_health.v1 import health_pb2

        self._pb = health_pb2
        self._ready = ready
        self._services = services

    def _status(self, service: str) -> int | None:
        if service not in self._services:
            return None
        response = self._pb.HealthCheckResponse
        return int(response.SERVING if self._ready() else response.NOT_SERVING)

    async def Check(self, request: Any, context: Any) -> Any:
        import grpc

        status = self._status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service}")
        return self._pb.HealthCheckResponse(status=status)

    async def List(self, request: Any, context: Any) -> Any:
        response = self._pb.HealthCheckResponse
        return self._pb.HealthListResponse(
            statuses={name: response(status=self._status(name)) for name in self._services}
        )

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        response = self._pb.HealthCheckResponse
        last: int | None = -1
        while True:
            status = self._status(request.service)
            if status != last:
                last = status
                yield response(status=response.SERVICE_UNKNOWN if status is None else status)
            await asyncio.sleep(_WATCH_INTERVAL_S)


class _LoopThread:
    """One thread running an asyncio loop that serves ``build(server)``'s gRPC services."""

    def __init__(self, host: str, port: int, options: list[tuple[str, int]]) -> None:
        self._address = host_port(host, port)
        self._options = options
        self._started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace_s = 0.0
        self._thread: threading.Thread | None = None

    def start(self, build: Callable[[Any], None]) -> int:
        """Start the thread and block until the server listens; its port. Blocking.

        :raises OSError: if the address cannot be bound.
        """
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main(build)), name="encdisagg-grpc", daemon=True
        )
        self._thread.start()
        return self._started.result()

    async def _main(self, build: Callable[[Any], None]) -> None:
        import grpc

        try:
            server = grpc.aio.server(options=self._options)
            build(server)
            try:
                port = server.add_insecure_port(self._address)
            except RuntimeError as exc:
                raise OSError(f"gRPC: cannot listen on {self._address}: {exc}") from None
            await server.start()
        except BaseException as exc:
            self._started.set_exception(exc)
            return
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._started.set_result(port)
        await self._stop.wait()
        await server.stop(self._grace_s)

    def stop(self, grace_s: float) -> None:
        """Stop serving (RPCs in flight get ``grace_s``) and end the thread. Blocking,
        bounded by ``grace_s`` plus a slack."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is None or stop is None or thread is None:
            return
        self._grace_s = grace_s
        loop.call_soon_threadsafe(stop.set)
        thread.join(grace_s + _STOP_SLACK_S)
        if thread.is_alive():
            _log.warning("the gRPC server did not stop within %.0f s; leaving it", grace_s)


class _Bridge:
    """Runs calls on the server's loop from the gRPC loop, through ``portal``."""

    def __init__(self, portal: anyio.from_thread.BlockingPortal) -> None:
        self._portal = portal

    async def __call__(self, call: Callable[[Any], Awaitable[object]], body: Any) -> object:
        from ..._errors import ServiceUnavailableError

        loop = asyncio.get_running_loop()
        finished = asyncio.Event()

        def wake() -> None:
            # RuntimeError: the gRPC loop has closed already, so nobody waits any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(finished.set)

        async def tracked() -> object:
            try:
                return await call(body)
            finally:
                wake()

        try:
            future = self._portal.start_task_soon(tracked)
        except RuntimeError:
            raise ServiceUnavailableError("the encoder service is shutting down") from None
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The RPC is gone: cancel its work, and end only once that work has stopped
            # (the portal runs ``tracked`` even when cancelled before it started).
            future.cancel()
            await finished.wait()
            raise


class GrpcServer(anyio.AsyncContextManagerMixin):
    """SGLang's ``SglangEncoder`` gRPC service, ``grpc.health.v1`` and reflection.

    :param calls: what the RPCs call (:class:`~._grpc_service.SglangCalls`), on the loop
        that enters this server.
    :param host: the address to listen on; ``port`` 0 picks a free port (see :attr:`port`).
    :param ready: whether the health service says SERVING; asked from the gRPC thread.
    :param api_key: when set, the SglangEncoder RPCs need ``authorization: Bearer KEY``.
    :param max_message_bytes: the largest request (and response) message.
    :param grace_s: how long RPCs in flight may finish when the server stops.

    Entering is a checkpoint that returns once the server listens. Leaving (also on
    cancellation) is shielded: it refuses new RPCs, gives those in flight ``grace_s``, then
    cancels the rest and waits for their work to stop.
    """

    def __init__(
        self,
        calls: SglangCalls,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ready: Callable[[], bool] = lambda: True,
        api_key: ApiKey | None = None,
        max_message_bytes: int = 256 * 1024 * 1024,
        grace_s: float = 5.0,
    ) -> None:
        self._calls = calls
        self._host = host
        self._requested_port = port
        self._ready = ready
        self._api_key = api_key
        self._max_message_bytes = max_message_bytes
        self._grace_s = grace_s
        self._port: int | None = None

    @property
    def port(self) -> int:
        """The port the server listens on (while entered)."""
        if self._port is None:
            raise RuntimeError("the gRPC server is not running")
        return self._port

    def _build(self, portal: anyio.from_thread.BlockingPortal) -> Callable[[Any], None]:
        from grpc_health.v1 import health_pb2_grpc
        from grpc_reflection.v1alpha import reflection
        from smg_grpc_proto.generated import sglang_encoder_pb2_grpc

        from ._grpc_service import SERVICE_NAME, SglangEncoderServicer

        servicer = SglangEncoderServicer(self._calls, _Bridge(portal), self._api_key)
        health = _Health(self._ready, ("", SERVICE_NAME))

        def build(server: Any) -> None:
            sglang_encoder_pb2_grpc.add_SglangEncoderServicer_to_server(servicer, server)
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            names = (SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, server)

        return build

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[GrpcServer]:
        problem = grpc_missing()
        if problem is not None:
            raise RuntimeError(problem)
        limit = self._max_message_bytes
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # grpcio binds with SO_REUSEPORT by default: a second server on a busy port
            # would share it silently instead of failing.
            ("grpc.so_reuseport", 0),
        ]
        thread = _LoopThread(self._host, self._requested_port, options)
        # The portal's task group would wrap a bind error, or the caller's own, in a group.
        with collapse_single_error():
            async with anyio.from_thread.BlockingPortal() as portal:
                build = self._build(portal)
                # Not abandoned on cancellation: the thread either listens or has failed.
                self._port = await anyio.to_thread.run_sync(thread.start, build)
                _log.info("gRPC serving on %s:%d", self._host, self._port)
                try:
                    yield self
                finally:
                    self._port = None
                    with anyio.CancelScope(shield=True):
                        # The portal stays open meanwhile: RPCs in their grace still need it.
                        await anyio.to_thread.run_sync(thread.stop, self._grace_s)
