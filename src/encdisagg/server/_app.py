"""The Quart app: our routes, the wire's routes beside them, and the service's lifespan.

The routes call an :class:`~._service.EncoderService`. The service (one Encoder, or
data-parallel workers) is opened by an ASGI middleware
around the app's lifespan: it opens the service when the server sends
``lifespan.startup``, runs the app's own lifespan inside it, and closes the service before
it reports ``lifespan.shutdown.complete``. The service's task groups therefore live inside
one ``async with`` block of one task — the server's lifespan task — and are never held open
across an async generator's ``yield`` (where a cancellation from inside them would land in
the framework's code). Hypercorn serves only once startup completed.
"""

from __future__ import annotations

import dataclasses
from typing import Final, Literal

from quart import Blueprint, Quart, Response, request
from werkzeug.exceptions import HTTPException

from .._config import EncoderConfig
from .._tracing import TRACEPARENT, server_span, set_status
from ..encoder import Encoder
from ._asgi._lifespan import ServiceLifespan
from ._asgi._request_log import AccessLog
from ._backend import Backend
from ._client_watch import ClientWatch, note_staged
from ._http_bodies import http_error_response
from ._logs import note_trace_id
from ._messages import (
    EncodeBody,
    MetadataBody,
    ReceiveUrlBody,
    ReleaseBody,
    SendBody,
    result_json,
)
from ._metrics import EncoderMetrics
from ._service import EncoderService, Route
from ._settings import ServerSettings
from ._sglang._grpc_beside import grpc_beside
from ._sglang._routes import mount_sglang
from ._vllm._routes import mount_vllm

__all__ = [
    "create_app",
    "create_trio_app",
    "mount_encoder",
]

Flavour = Literal["asyncio", "trio"]

_EXTENSION: Final = "encdisagg"


async def _encode(service: EncoderService, backend: Backend, body: object) -> object:
    message = EncodeBody.from_json(body)
    result = await backend.encode(message)
    note_staged(message.req_id)  # released if the client leaves before the answer
    return result_json(result, message.part_idx)


async def _send(service: EncoderService, backend: Backend, body: object) -> object:
    message = SendBody.from_json(body)
    if service.peers is not None:
        # Before the backend: no connection is opened, no name looked up.
        service.peers.check_destination(message.destination, req_id=message.req_id)
    await backend.send(message)
    return None


async def _register(service: EncoderService, backend: Backend, body: object) -> object:
    message = ReceiveUrlBody.from_json(body)
    if service.peers is not None:
        for index, url in enumerate(message.receive_urls):
            service.peers.check(f"receive_url[{index}]", url, req_id=message.req_id)
    await backend.register(message)
    return None


async def _metadata(service: EncoderService, backend: Backend, body: object) -> object:
    message = MetadataBody.from_json(body)
    return result_json(await backend.metadata(message), message.part_idx)


async def _release(service: EncoderService, backend: Backend, body: object) -> object:
    await backend.release(ReleaseBody.from_json(body).req_id)
    return None


_ROUTES: Final[dict[str, Route]] = {
    "/encode": _encode,
    "/send": _send,
    "/scheduler_receive_url": _register,
    "/scheduler_receive_meta_data": _metadata,
    "/release": _release,
}


def mount_encoder(
    app: Quart,
    config_or_encoder: EncoderConfig | Encoder,
    *,
    settings: ServerSettings | None = None,
    url_prefix: str | None = None,
    encoder_metrics: EncoderMetrics | None = None,
    api_key: str | None = None,
) -> EncoderService:
    """Add the encoder routes to an existing Quart (or QuartTrio) app.

    Registers a blueprint with ``/encode``, ``/send``, ``/scheduler_receive_url``,
    ``/scheduler_receive_meta_data``, ``/release``, ``/health``, ``/health/live``,
    ``/health/ready`` and ``/metrics`` (under
    ``url_prefix``), and wraps ``app.asgi_app`` so the app's lifespan opens the encoder
    service first and closes it last. Sets ``MAX_CONTENT_LENGTH`` if the app has none.

    Built from an :class:`~encdisagg.EncoderConfig`, the Encoder never reads local files
    named by clients (``allow_local_files`` is turned off). A given
    :class:`~encdisagg.Encoder` is used as it is: opened by the lifespan unless already open;
    pass ``encoder_metrics`` if it was built with ``events=encoder_metrics.events()``.
    ``api_key`` (overriding ``settings.api_key``) makes every route but ``/health`` and
    ``/metrics`` require ``Authorization: Bearer <api_key>``.

    :returns: the service (also at ``app.extensions["encdisagg"]``).
    :raises RuntimeError: if the app has an encoder mounted already.
    :raises BadRequestError: if ``api_key`` is empty or not visible ASCII.
    """
    if _EXTENSION in app.extensions:
        raise RuntimeError("this app has an encoder mounted already")
    if api_key is not None:
        settings = dataclasses.replace(settings or ServerSettings(), api_key=api_key)
    # SGLang's gRPC service (settings.grpc_port) runs beside the routes: handed in, so
    # that the service imports no wire.
    service = EncoderService(
        config_or_encoder, settings, encoder_metrics=encoder_metrics, beside=grpc_beside
    )
    blueprint = Blueprint("encdisagg", __name__, url_prefix=url_prefix)

    def add_route(path: str, call: Route) -> None:
        async def view() -> Response:
            with server_span(path, request.headers.get(TRACEPARENT)) as trace:
                if trace is not None:
                    note_trace_id(trace.trace_id)
                response = await service._respond(path, call)
                set_status(trace, response.status_code)
                return response

        blueprint.add_url_rule(path, path.strip("/"), view, methods=["POST"])

    routes = dict(_ROUTES)
    # GET, without the API key: the probes and the scrape.
    probes = {
        "/health": service.health,
        "/health/live": service.live,
        "/health/ready": service.ready,
        "/metrics": service.render_metrics,
    }
    if service.settings.wire == "sglang":  # SGLang's language side talks to us (docs/sglang.md)
        routes.update(mount_sglang(app, service))
        probes["/health_generate"] = service.health
    elif service.settings.wire == "vllm":  # vLLM's encoder proxy calls us (docs/vllm.md)
        routes.update(mount_vllm(app, blueprint, service))
    for path, call in routes.items():
        add_route(path, call)
    for path, probe in probes.items():
        blueprint.add_url_rule(path, path.strip("/").replace("/", "_"), probe, methods=["GET"])
    app.register_blueprint(blueprint)
    if app.config.get("MAX_CONTENT_LENGTH") is None:
        app.config["MAX_CONTENT_LENGTH"] = service.settings.max_body_bytes
    app.extensions[_EXTENSION] = service
    prefix = (url_prefix or "").rstrip("/")
    paths = [*routes, *probes]
    app.asgi_app = AccessLog(  # type: ignore[method-assign,assignment]
        ClientWatch(ServiceLifespan(app.asgi_app, service, loop=_loop_of(app)), service),
        routes=[prefix + path for path in paths],
        observe=service.metrics.observe_http,
        dropped=lambda: service.stopped_at_once,
    )
    return service


def _loop_of(app: Quart) -> Literal["asyncio", "trio"]:
    """The event loop ``app``'s class runs on."""
    try:
        from quart_trio import QuartTrio
    except ImportError:  # the trio extra is not installed: no app can be a QuartTrio
        return "asyncio"
    return "trio" if isinstance(app, QuartTrio) else "asyncio"


def create_app(
    config_or_encoder: EncoderConfig | Encoder,
    *,
    settings: ServerSettings | None = None,
    flavour: Flavour = "asyncio",
    encoder_metrics: EncoderMetrics | None = None,
) -> Quart:
    """An encoder server app (DESIGN §4.7): JSON in, JSON out.

    ``flavour="asyncio"`` gives a :class:`quart.Quart` app (serve it with
    ``hypercorn.asyncio``); ``"trio"`` a :class:`quart_trio.QuartTrio` app (serve it with
    ``hypercorn.trio``). The Encoder (or the data-parallel workers, ``settings.dp > 1``) is
    opened in the app's lifespan; see :func:`mount_encoder`. Errors, also for unknown routes
    and methods, are ``{"status": "error", "message", "req_id"}`` with the error's status.
    """
    app: Quart
    if flavour == "asyncio":
        app = Quart("encdisagg.server")
    elif flavour == "trio":
        from quart_trio import QuartTrio

        app = QuartTrio("encdisagg.server")
    else:
        raise ValueError(f"flavour must be 'asyncio' or 'trio'; got {flavour!r}")
    service = mount_encoder(
        app, config_or_encoder, settings=settings, encoder_metrics=encoder_metrics
    )
    app.config["MAX_CONTENT_LENGTH"] = service.settings.max_body_bytes

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        return http_error_response(exc, service.settings.max_body_bytes)

    return app


def create_trio_app(
    config_or_encoder: EncoderConfig | Encoder,
    *,
    settings: ServerSettings | None = None,
    encoder_metrics: EncoderMetrics | None = None,
) -> Quart:
    """:func:`create_app` with ``flavour="trio"``: a ``QuartTrio`` app."""
    return create_app(
        config_or_encoder, settings=settings, flavour="trio", encoder_metrics=encoder_metrics
    )
