"""The HTTP routes of ``--wire sglang``: SGLang's encoder routes over :class:`SglangService`.

``/encode``, ``/send``, ``/scheduler_receive_url`` and ``/scheduler_receive_meta_data`` take
the bodies SGLang's language side sends and answer as SGLang's encoder does; ``/release``,
``/health*`` and ``/metrics`` stay ours, and ``/health_generate`` answers like ``/health``.
The service is opened inside the encoder service's lifespan (after the Encoder, closed
before it), together with the bootstrap registration when ``register_with`` is set.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from quart import Quart

from ..._errors import BadRequestError, ServiceUnavailableError
from .._asgi._lifespan import ServiceLifespan
from .._backend import Backend
from .._fields import type_name
from .._service import EncoderService, Route
from ._register import registered_with
from ._service import SglangService

__all__ = ["SglangWire", "mount_sglang"]

_Call = Callable[[SglangService, Mapping[str, object]], Awaitable[object]]


class SglangWire:
    """The sglang wire of one app: its :class:`SglangService` while the app runs.

    :ivar sglang: the open service, ``None`` outside the app's lifespan.
    """

    def __init__(self, service: EncoderService) -> None:
        self._service = service
        self.sglang: SglangService | None = None

    @asynccontextmanager
    async def open(self) -> AsyncGenerator[SglangService]:
        """Open the service over the running backend (and register with the bootstrap).

        Entering is a checkpoint; leaving unregisters first, then closes the service.
        """
        service = self._service
        settings = service.settings
        backend = service.require_backend()
        async with SglangService(backend, service.config, peers=service.peers) as sglang:
            self.sglang = sglang
            try:
                if settings.register_with is None:
                    yield sglang
                else:
                    if settings.advertise_url is None:
                        raise BadRequestError(
                            "register_with needs advertise_url: this server's URL"
                        )
                    async with registered_with(settings.register_with, settings.advertise_url):
                        yield sglang
            finally:
                self.sglang = None

    def route(self, call: _Call) -> Route:
        """A route of the app calling ``call`` with the decoded body."""

        async def handle(service: EncoderService, backend: Backend, body: object) -> object:
            sglang = self.sglang
            if sglang is None:
                raise ServiceUnavailableError("the SGLang wire is not running")
            if not isinstance(body, Mapping):
                raise BadRequestError(f"the body must be a JSON object, got {type_name(body)}")
            return await call(sglang, body)

        return handle


def mount_sglang(app: Quart, service: EncoderService) -> dict[str, Route]:
    """Open the wire inside ``app``'s lifespan, and return SGLang's routes (path → route) in
    place of ours (the app adds ``/health_generate``, SGLang's probe, beside ``/health``).
    Call it before the encoder service's own lifespan wraps ``app`` (so it runs inside it)."""
    wire = SglangWire(service)
    app.asgi_app = ServiceLifespan(app.asgi_app, wire)  # type: ignore[method-assign,assignment]
    calls: dict[str, Any] = {
        "/encode": SglangService.encode,
        "/send": SglangService.send,
        "/scheduler_receive_url": SglangService.scheduler_receive_url,
        "/scheduler_receive_meta_data": SglangService.scheduler_receive_meta_data,
    }
    return {path: wire.route(call) for path, call in calls.items()}
