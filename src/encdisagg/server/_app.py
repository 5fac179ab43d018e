"""The Quart app: routes, strict bodies, JSON errors, and the Encoder's lifespan.

The encoder service (one Encoder, or data-parallel workers) is opened by an ASGI middleware
around the app's lifespan: it opens the service when the server sends
``lifespan.startup``, runs the app's own lifespan inside it, and closes the service before
it reports ``lifespan.shutdown.complete``. The service's task groups therefore live inside
one ``async with`` block of one task — the server's lifespan task — and are never held open
across an async generator's ``yield`` (where a cancellation from inside them would land in
the framework's code). Hypercorn serves only once startup completed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Final, Literal

import anyio
from quart import Blueprint, Quart, Response, current_app, request
from werkzeug.exceptions import HTTPException

from .._config import EncoderConfig
from .._errors import BadRequestError, EncdisaggError, ServiceUnavailableError
from .._tracing import TRACEPARENT, server_span, set_status
from ..encoder import Encoder
from ._access import ApiKey, PeerAllowList
from ._backend import Backend, LocalBackend
from ._client_watch import ClientWatch, note_staged
from ._dp import DataParallelBackend
from ._grpc_serving import grpc_beside
from ._http_bodies import (
    error_response,
    http_error_response,
    json_response,
    public_message,
    read_json,
    require_json_type,
)
from ._lifespan import ServiceLifespan
from ._logs import note_req_id, note_trace_id
from ._messages import (
    EncodeBody,
    MetadataBody,
    ReceiveUrlBody,
    ReleaseBody,
    SendBody,
    result_json,
)
from ._metrics import EncoderMetrics, ServerMetrics
from ._probes import readiness_problem
from ._request_log import AccessLog
from ._settings import ServerSettings
from ._sglang_routes import mount_sglang
from ._vllm._routes import mount_vllm

__all__ = [
    "EncoderService",
    "create_app",
    "create_trio_app",
    "mount_encoder",
]

#: The routes that start new encodes: the drain refuses them once its delay passed.
_NEW_WORK_ROUTES: Final = frozenset({"/encode", "/v1/chat/completions"})

_log = logging.getLogger("encdisagg.server")

Flavour = Literal["asyncio", "trio"]

#: Threads decoding large bodies at once. ``json.loads`` holds the GIL; fewer such threads
#: leave the event loop's thread more of it, so other requests keep being answered.
_DECODE_THREADS: Final = 2
_PROMETHEUS_TEXT: Final = "text/plain; version=0.0.4; charset=utf-8"
_EXTENSION: Final = "encdisagg"


class EncoderService:
    """The encoder behind one app's routes: settings, metrics, and the running backend.

    Built by :func:`mount_encoder`; the app's lifespan opens it. ``app.extensions
    ["encdisagg"]`` holds it.

    :ivar metrics: the app's metrics; ``metrics.registry`` is its Prometheus registry.
    """

    def __init__(
        self,
        config_or_encoder: EncoderConfig | Encoder,
        settings: ServerSettings | None = None,
        *,
        encoder_metrics: EncoderMetrics | None = None,
    ) -> None:
        self.settings = settings or ServerSettings()
        self.metrics = ServerMetrics()
        self._encoder_metrics = encoder_metrics or EncoderMetrics()
        self._source: EncoderConfig | Encoder
        if isinstance(config_or_encoder, Encoder):
            if self.settings.dp != 1:
                raise BadRequestError(
                    "dp: data-parallel workers build their own Encoders; pass an EncoderConfig"
                )
            self._source = config_or_encoder
        elif isinstance(config_or_encoder, EncoderConfig):
            # Clients must not make the server read its own files.
            self._source = config_or_encoder.replace(allow_local_files=False)
        else:
            raise TypeError(
                f"expected an EncoderConfig or an Encoder, got {type(config_or_encoder).__name__}"
            )
        config = self.config
        self.metrics.set_info(
            model=config.model, transfer=config.transfer, dp=str(self.settings.dp)
        )
        self._backend: Backend | None = None
        #: A drain began: readiness is false from then on.
        self.draining = False
        #: The drain's delay passed: new encodes are answered 503 (``encdisagg serve``).
        self.refusing_encodes = False
        #: A second signal stopped the server at once: what it cut short was dropped.
        self.stopped_at_once = False
        self._decode_limiter: anyio.CapacityLimiter | None = None
        key = self.settings.api_key
        self._api_key = None if key is None else ApiKey(key)
        peers = self.settings.allowed_peers
        #: ``None``: any destination (the default, as in SGLang and vLLM).
        self.peers = None if peers is None else PeerAllowList.parse(peers)

    @property
    def config(self) -> EncoderConfig:
        """The Encoder's configuration (as served: local files off when built here)."""
        source = self._source
        return source.config if isinstance(source, Encoder) else source

    @property
    def backend(self) -> Backend | None:
        """The running backend, or ``None`` outside the app's lifespan."""
        return self._backend

    @asynccontextmanager
    async def open(self) -> AsyncGenerator[Backend]:
        """Run the backend: open the Encoder, or start and stop the data-parallel workers.

        Entering is a checkpoint that returns once the service can encode; leaving releases
        every request, drains transfers (bounded by ``shutdown_grace_s``) and stops workers.
        """
        if self._backend is not None:
            raise RuntimeError("the encoder service is running already")
        backend: LocalBackend | DataParallelBackend
        if self.settings.dp > 1:
            backend = DataParallelBackend(
                self.config, workers=self.settings.dp, settings=self.settings
            )
        else:
            backend = LocalBackend(
                self._source,
                metrics=self._encoder_metrics,
                health_timeout_s=self.settings.health_timeout_s,
                freeze_heap=self.settings.freeze_heap,
            )
        self._decode_limiter = anyio.CapacityLimiter(_DECODE_THREADS)
        async with backend:
            self._backend = backend
            self.draining = False
            try:
                # SGLang's gRPC encoder service (settings.grpc_port): up after the Encoder,
                # stopped before it closes.
                async with grpc_beside(self, backend):
                    yield backend
            finally:
                # Closing drains: not ready from the first moment on.
                self.draining = True
                self._backend = None

    def start_draining(self) -> None:
        """Turn readiness false now: a graceful drain begins (``encdisagg serve`` calls it
        on its first signal, before it stops accepting). Not async; nothing else changes:
        requests still get served until the server stops."""
        self.draining = True

    def refuse_encodes(self) -> None:
        """Answer new encodes 503 (with ``Retry-After``) from now on; calls for requests
        already admitted are still served. Not async (``encdisagg serve``'s drain)."""
        self.draining = True
        self.refusing_encodes = True

    def admit(self, route: str, body: object) -> None:
        """Take a call to ``route`` (HTTP, or the gRPC RPC of the same name) now, or refuse
        it. Not async.

        :raises ServiceUnavailableError: a new encode while the drain refuses them.
        """
        if route in _NEW_WORK_ROUTES and self.refusing_encodes:
            req_id = body.get("req_id") if isinstance(body, dict) else None
            raise ServiceUnavailableError(
                "the server is draining: it takes no new encodes; send this one to another encoder",
                req_id=req_id if isinstance(req_id, str) else None,
            )

    def _require_backend(self) -> Backend:
        if self._backend is None:
            raise ServiceUnavailableError("the encoder service is not running")
        return self._backend

    # -- request handling ------------------------------------------------------------------

    async def _respond(self, route: str, call: _Route) -> Response:
        try:
            if self._api_key is not None and not self._api_key.allows(
                request.headers.get("Authorization")
            ):
                response = error_response(401, "missing or wrong API key", None)
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
            require_json_type()
            body = await read_json(self.settings.max_body_bytes, self._decode_limiter)
            if isinstance(body, dict):
                note_req_id(body.get("req_id"))
            backend = self._require_backend()
            self.admit(route, body)
            response = json_response(await call(self, backend, body))
        except EncdisaggError as exc:
            note_req_id(exc.req_id)
            response = error_response(exc.status, public_message(exc.message), exc.req_id)
        except HTTPException as exc:
            response = http_error_response(exc, self.settings.max_body_bytes)
        except Exception:
            _log.exception("%s failed unexpectedly", route)
            response = error_response(500, "internal server error", None)
        return response

    async def health(self) -> Response:
        """``GET /health``: 200 when the model answers a probe (or is busy), else 503."""
        try:
            report = await self._require_backend().health()
        except EncdisaggError as exc:
            response = error_response(503, public_message(exc.message), None)
        except Exception:
            _log.exception("/health failed unexpectedly")
            response = error_response(503, "the health check failed", None)
        else:
            if report.ok:
                response = json_response({"status": "ok", "probed": report.probed})
            else:
                response = error_response(503, public_message(report.message), None)
        return response

    async def live(self) -> Response:
        """``GET /health/live``: 200 while the process serves requests at all."""
        return json_response({"status": "ok"})

    async def ready(self) -> Response:
        """``GET /health/ready``: 200 when the model is loaded, no drain began and (data
        parallel) every worker is up; else 503 naming why. Runs no probe."""
        problem = readiness_problem(self._backend, draining=self.draining)
        if problem is None:
            response = json_response({"status": "ok"})
        else:
            response = error_response(503, problem, None)
        return response

    async def render_metrics(self) -> Response:
        """``GET /metrics``: Prometheus text."""
        backend = self._backend
        if backend is not None:
            try:
                self.metrics.update(await backend.snapshot())
            except Exception:
                _log.exception("collecting metrics failed; serving the previous ones")
        response: Response = current_app.response_class(
            self.metrics.render(), status=200, content_type=_PROMETHEUS_TEXT
        )
        return response


_Route = Callable[[EncoderService, Backend, object], Awaitable[object]]


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
            endpoint = url.removeprefix("tcp://")
            service.peers.check(f"receive_url[{index}]", endpoint, req_id=message.req_id)
    await backend.register(message)
    return None


async def _metadata(service: EncoderService, backend: Backend, body: object) -> object:
    message = MetadataBody.from_json(body)
    return result_json(await backend.metadata(message), message.part_idx)


async def _release(service: EncoderService, backend: Backend, body: object) -> object:
    await backend.release(ReleaseBody.from_json(body).req_id)
    return None


_ROUTES: Final[dict[str, _Route]] = {
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
    service = EncoderService(config_or_encoder, settings, encoder_metrics=encoder_metrics)
    blueprint = Blueprint("encdisagg", __name__, url_prefix=url_prefix)

    def add_route(path: str, call: _Route) -> None:
        async def view() -> Response:
            with server_span(path, request.headers.get(TRACEPARENT)) as trace:
                if trace is not None:
                    note_trace_id(trace.trace_id)
                response = await service._respond(path, call)
                set_status(trace, response.status_code)
                return response

        blueprint.add_url_rule(path, path.strip("/"), view, methods=["POST"])

    routes = dict(_ROUTES)
    if service.settings.wire == "sglang":  # SGLang's language side talks to us (docs/sglang.md)
        routes.update(mount_sglang(app, blueprint, service))
    elif service.settings.wire == "vllm":  # vLLM's encoder proxy calls us (docs/vllm.md)
        routes.update(mount_vllm(app, blueprint, service))
    for path, call in routes.items():
        add_route(path, call)
    blueprint.add_url_rule("/health", "health", service.health, methods=["GET"])
    blueprint.add_url_rule("/health/live", "health_live", service.live, methods=["GET"])
    blueprint.add_url_rule("/health/ready", "health_ready", service.ready, methods=["GET"])
    blueprint.add_url_rule("/metrics", "metrics", service.render_metrics, methods=["GET"])
    app.register_blueprint(blueprint)
    if app.config.get("MAX_CONTENT_LENGTH") is None:
        app.config["MAX_CONTENT_LENGTH"] = service.settings.max_body_bytes
    app.extensions[_EXTENSION] = service
    prefix = (url_prefix or "").rstrip("/")
    paths = [*routes, "/health", "/health/live", "/health/ready", "/metrics"]
    if service.settings.wire == "sglang":
        paths.append("/health_generate")
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
