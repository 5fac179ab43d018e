"""The gRPC server of an encoder app: what it calls, when it says SERVING, how it stops.

:func:`grpc_beside` runs inside the encoder service's lifespan (``EncoderService.open``),
once the Encoder (or the data-parallel workers) run, and is left before they close:

- the RPCs call an :class:`~._service.SglangService` of their own over the running
  backend, whichever ``wire`` the HTTP routes speak. Its part state (registered
  destinations, Mooncake parts awaiting ``Send``) is its own: a part encoded over gRPC is
  registered and sent over gRPC, as SGLang's gRPC language side does anyway;
- health says SERVING exactly when ``/health/ready`` answers 200: NOT_SERVING from the
  first moment of a drain (``encdisagg serve``'s first signal), while the gRPC server
  still serves the RPCs that finish the parts in flight; once the drain refuses new encodes,
  ``Encode`` is ``UNAVAILABLE`` as ``/encode`` is 503;
- leaving stops the gRPC server (new RPCs refused, those in flight get the Encoder's
  ``shutdown_grace_s``, then are cancelled) before the Encoder releases what is left.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING

from .._access import ApiKey
from .._asgi._listen import host_port
from .._backend import Backend
from .._probes import readiness_problem
from .._service import EncoderService
from ._grpc_server import GrpcServer, grpc_missing
from ._service import SglangService

if TYPE_CHECKING:
    # The grpc extra may be missing: its modules load only once a gRPC port is asked for.
    from ._grpc_service import SglangCalls

__all__ = ["grpc_beside"]


@asynccontextmanager
async def grpc_beside(service: EncoderService, backend: Backend) -> AsyncGenerator[str | None]:
    """Serve SGLang's gRPC encoder service beside ``service``'s routes while entered.

    Does nothing (yields ``None``) unless ``service.settings.grpc_port`` is set; else yields
    ``grpc://host:port`` (the form SGLang's ``--encoder-urls`` takes). Entering is a
    checkpoint that returns once the gRPC server listens; leaving is shielded and bounded
    (see :class:`~._grpc_server.GrpcServer`).

    :raises RuntimeError: naming the ``grpc`` extra, when a package of it is missing.
    :raises OSError: if the gRPC address cannot be bound.
    """
    settings = service.settings
    if settings.grpc_port is None:
        yield None
        return
    problem = grpc_missing()
    if problem is not None:
        raise RuntimeError(problem)

    def ready() -> bool:
        # Asked from the gRPC thread: plain reads of the service's state.
        return readiness_problem(service.backend, draining=service.draining) is None

    async with AsyncExitStack() as stack:
        sglang = await stack.enter_async_context(
            SglangService(backend, service.config, peers=service.peers)
        )
        server = GrpcServer(
            _Admitted(service, sglang),
            host=settings.grpc_host,
            port=settings.grpc_port,
            ready=ready,
            api_key=None if settings.api_key is None else ApiKey(settings.api_key),
            max_message_bytes=settings.max_body_bytes,
            grace_s=service.config.shutdown_grace_s,
        )
        await stack.enter_async_context(server)
        yield f"grpc://{host_port(settings.grpc_host, server.port)}"


class _Admitted:
    """The SGLang calls the RPCs make, with ``Encode`` refused as ``/encode`` is while the
    drain refuses new encodes (``UNAVAILABLE``); ``Send`` and ``SchedulerReceiveUrl`` for
    parts already admitted go on."""

    def __init__(self, service: EncoderService, calls: SglangCalls) -> None:
        self._service = service
        self._calls = calls

    async def encode(self, body: Mapping[str, object]) -> object:
        self._service.admit("/encode", body)
        return await self._calls.encode(body)

    async def send(self, body: Mapping[str, object]) -> object:
        return await self._calls.send(body)

    async def scheduler_receive_url(self, body: Mapping[str, object]) -> object:
        return await self._calls.scheduler_receive_url(body)
