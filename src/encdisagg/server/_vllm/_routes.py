"""The HTTP route of ``--wire vllm``: vLLM's proxy's encoder call over :class:`VllmService`.

``POST /v1/chat/completions`` takes the proxy's body and answers its ``ec_transfer_params``;
errors of that route are answered in vLLM's own error body,
``{"error": {"message", "type", "param", "code"}}``. Our routes (``/encode``...),
``/health*`` and ``/metrics`` stay as they are (the proxy probes ``GET /health``). The
service is opened inside the encoder service's lifespan: after the Encoder, closed before it.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Final

from quart import Blueprint, Quart, Response, request

from ..._errors import ServiceUnavailableError
from .._asgi._lifespan import ServiceLifespan
from .._backend import Backend
from .._fields import valid_req_id
from .._logs import note_req_id
from .._service import EncoderService, Route
from ._service import VllmService, check_connector

__all__ = ["CHAT_PATH", "VllmWire", "mount_vllm", "vllm_error"]

CHAT_PATH: Final = "/v1/chat/completions"

#: A message naming a field first: ``"messages[0].content[1].uuid is missing"``.
_PARAM: Final = re.compile(r"((?:[a-z_]+(?:\[\d+\])*\.)*[a-z_]+(?:\[\d+\])*) (?:is|must) ")
#: vLLM's error types for the statuses it names itself.
_TYPES: Final = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


class VllmWire:
    """The vllm wire of one app: its :class:`VllmService` while the app runs.

    :ivar vllm: the open service, ``None`` outside the app's lifespan.
    """

    def __init__(self, service: EncoderService) -> None:
        self._service = service
        self.vllm: VllmService | None = None

    @asynccontextmanager
    async def open(self) -> AsyncGenerator[VllmService]:
        """Open the service over the running backend. Entering is a checkpoint."""
        service = self._service
        backend = service.require_backend()
        async with VllmService(
            backend, service.config, service.settings, peers=service.peers
        ) as vllm:
            self.vllm = vllm
            try:
                yield vllm
            finally:
                self.vllm = None

    async def chat(self, service: EncoderService, backend: Backend, body: object) -> object:
        proxy_id = request.headers.get("x-request-id")
        if valid_req_id(proxy_id):
            note_req_id(proxy_id)  # the proxy's id in this request's log lines
        vllm = self.vllm
        if vllm is None:
            raise ServiceUnavailableError("the vLLM wire is not running")
        return await vllm.chat(body)


def vllm_error(status: int, message: str) -> dict[str, object]:
    """vLLM's error body for ``status``; ``param`` is the field a message starts by naming
    (``messages[0].content[1].uuid is missing...``), else ``None``."""
    named = _PARAM.match(message)
    kind = _TYPES.get(status)
    if kind is None:
        try:
            phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
        except ValueError:
            phrase = "Unknown"
        kind = phrase if phrase.endswith("Error") else phrase + "Error"
    param = None if named is None else named.group(1)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def mount_vllm(app: Quart, blueprint: Blueprint, service: EncoderService) -> dict[str, Route]:
    """Open the wire inside ``app``'s lifespan, answer its route's errors in vLLM's shape,
    and return its route (path -> route) to add beside ours. Call it before the encoder
    service's own lifespan wraps ``app`` (so it runs inside it).

    :raises ConfigError: settings the wire cannot serve with (checked now, not at startup).
    """
    wire = VllmWire(service)
    # Checked at once: a connector that cannot work fails the mount, not the startup.
    check_connector(service.config, service.settings)
    app.asgi_app = ServiceLifespan(app.asgi_app, wire)  # type: ignore[method-assign,assignment]
    endpoint = f"{blueprint.name}.{CHAT_PATH.strip('/')}"

    @blueprint.after_request
    async def vllm_errors(response: Response) -> Response:
        if request.endpoint != endpoint or response.status_code < 400:
            return response
        try:
            ours = json.loads(await response.get_data(as_text=True))
            message = str(ours["message"])
        except (ValueError, KeyError, TypeError):
            return response
        response.set_data(json.dumps(vllm_error(response.status_code, message)))
        return response

    return {CHAT_PATH: wire.chat}
