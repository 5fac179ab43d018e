"""The encoder service behind one app's routes: its settings, its backend, its answers.

:class:`EncoderService` opens the backend (one Encoder, or the data-parallel front), knows
whether a drain began, and turns a route's call into the JSON answer or error every wire
shares. The wires' routes (our own in ``_app``, SGLang's and vLLM's in their wings) call
into it; it imports none of them. What runs beside the routes, such as SGLang's gRPC
server, is handed in as a :data:`Beside` and entered while the backend runs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Final

import anyio
from quart import Response, current_app, request
from werkzeug.exceptions import HTTPException

from .._config import EncoderConfig
from .._errors import BadRequestError, EncdisaggError, ServiceUnavailableError
from ..encoder import Encoder
from ._access import ApiKey, PeerAllowList
from ._backend import Backend, LocalBackend
from ._dp._front import DataParallelBackend
from ._http_bodies import (
    error_response,
    http_error_response,
    json_response,
    read_json,
    require_json_type,
)
from ._json import public_message
from ._logs import note_req_id
from ._metrics import EncoderMetrics, ServerMetrics
from ._probes import readiness_problem
from ._settings import ServerSettings

__all__ = ["Beside", "EncoderService", "Route"]

#: The routes that start new encodes: the drain refuses them once its delay passed.
_NEW_WORK_ROUTES: Final = frozenset({"/encode", "/v1/chat/completions"})

#: Threads decoding large bodies at once. ``json.loads`` holds the GIL; fewer such threads
#: leave the event loop's thread more of it, so other requests keep being answered.
_DECODE_THREADS: Final = 2
_PROMETHEUS_TEXT: Final = "text/plain; version=0.0.4; charset=utf-8"

_log = logging.getLogger("encdisagg.server")


class EncoderService:
    """The encoder behind one app's routes: settings, metrics, and the running backend.

    Built by :func:`mount_encoder`; the app's lifespan opens it. ``app.extensions
    ["encdisagg"]`` holds it.

    :param beside: what runs beside the routes while the backend runs (the app hands in
        SGLang's gRPC server), entered after the backend opened and left before it closes.
    :ivar metrics: the app's metrics; ``metrics.registry`` is its Prometheus registry.
    """

    def __init__(
        self,
        config_or_encoder: EncoderConfig | Encoder,
        settings: ServerSettings | None = None,
        *,
        encoder_metrics: EncoderMetrics | None = None,
        beside: Beside | None = None,
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
        #: What runs beside the routes, and the URL it reported while it runs.
        self._beside = beside
        self._beside_url: str | None = None

    @property
    def config(self) -> EncoderConfig:
        """The Encoder's configuration (as served: local files off when built here)."""
        source = self._source
        return source.config if isinstance(source, Encoder) else source

    @property
    def backend(self) -> Backend | None:
        """The running backend, or ``None`` outside the app's lifespan."""
        return self._backend

    @property
    def grpc_url(self) -> str | None:
        """``grpc://host:port`` of the gRPC server beside the routes (the form SGLang's
        ``--encoder-urls`` takes) while the service runs one, else ``None``."""
        return self._beside_url

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
        beside = self._beside or _nothing_beside
        async with backend:
            self._backend = backend
            self.draining = False
            try:
                # What runs beside the routes (SGLang's gRPC service, settings.grpc_port):
                # up after the Encoder, stopped before it closes.
                async with beside(self, backend) as url:
                    self._beside_url = url
                    try:
                        yield backend
                    finally:
                        self._beside_url = None
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

    def require_backend(self) -> Backend:
        """The running backend. Not async.

        :raises ServiceUnavailableError: outside the app's lifespan.
        """
        if self._backend is None:
            raise ServiceUnavailableError("the encoder service is not running")
        return self._backend

    # -- request handling ------------------------------------------------------------------

    async def _respond(self, route: str, call: Route) -> Response:
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
            backend = self.require_backend()
            self.admit(route, body)
            return json_response(await call(self, backend, body))
        except EncdisaggError as exc:
            note_req_id(exc.req_id)
            return error_response(exc.status, public_message(exc.message), exc.req_id)
        except HTTPException as exc:
            return http_error_response(exc, self.settings.max_body_bytes)
        except Exception:
            _log.exception("%s failed unexpectedly", route)
            return error_response(500, "internal server error", None)

    async def health(self) -> Response:
        """``GET /health``: 200 when the model answers a probe (or is busy), else 503."""
        try:
            report = await self.require_backend().health()
        except EncdisaggError as exc:
            return error_response(503, public_message(exc.message), None)
        except Exception:
            _log.exception("/health failed unexpectedly")
            return error_response(503, "the health check failed", None)
        if report.ok:
            return json_response({"status": "ok", "probed": report.probed})
        return error_response(503, public_message(report.message), None)

    async def live(self) -> Response:
        """``GET /health/live``: 200 while the process serves requests at all."""
        return json_response({"status": "ok"})

    async def ready(self) -> Response:
        """``GET /health/ready``: 200 when the model is loaded, no drain began and (data
        parallel) every worker is up; else 503 naming why. Runs no probe."""
        problem = readiness_problem(self._backend, draining=self.draining)
        if problem is None:
            return json_response({"status": "ok"})
        return error_response(503, problem, None)

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


#: One route's work: the service, its running backend, the decoded JSON body -> the answer.
Route = Callable[[EncoderService, Backend, object], Awaitable[object]]

#: Runs beside the routes while the backend runs; yields the URL it serves on, if any.
Beside = Callable[[EncoderService, Backend], AbstractAsyncContextManager[str | None]]


@asynccontextmanager
async def _nothing_beside(service: EncoderService, backend: Backend) -> AsyncIterator[None]:
    yield None
