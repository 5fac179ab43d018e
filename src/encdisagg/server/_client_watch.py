"""Releasing what an ``/encode`` staged for a client that left before its answer went out.

The framework notices a client that disconnects by cancelling its handler, but that is not
enough on its own. On Python 3.11, ``asyncio.wait_for`` (Quart reads the body through it)
swallows a cancellation that arrives in the same pass of the loop as the body's last part,
which is exactly what a client that sends its request and leaves at once produces: its
encode then runs as if it were still wanted. And a cancellation that lands after the encode
returned but before the answer was written (the client left at about the moment its encode
finished) stops the answer, not the staging. Either way the embedding stayed staged, and
its connection open, until the request's send deadline.

This ASGI middleware watches each HTTP exchange: the ``http.disconnect`` the server
reports, and the answer's last part being handed to the server. A route that staged a
request tells it :func:`note_staged`; when the exchange ends, a request staged for a client
that left first (or whose answer never went out) is released.
"""

from __future__ import annotations

import logging
import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from quart import request
from werkzeug.exceptions import RequestTimeout

from .._config import EncoderConfig
from ._asgi._middleware import App, Middleware, Receive, Scope, Send
from ._backend import Backend, release_within

__all__ = ["ClientWatch", "note_staged", "read_body"]

_log = logging.getLogger("encdisagg.server")


class _Service(Protocol):
    """What the watch needs of the encoder service."""

    @property
    def config(self) -> EncoderConfig: ...

    @property
    def backend(self) -> Backend | None: ...


@dataclass(eq=False, slots=True)
class _Exchange:
    """One HTTP request and its answer, as the watch sees them."""

    #: The server reported the client gone before the answer's last part was handed over.
    left: bool = False
    #: The answer's last part was handed to the server.
    answered: bool = False
    #: The ``req_id`` this exchange's encode staged, if any.
    staged: str | None = None

    @property
    def abandoned(self) -> bool:
        return self.left or not self.answered


_CURRENT: ContextVar[_Exchange | None] = ContextVar("encdisagg_exchange", default=None)


def note_staged(req_id: str) -> None:
    """Record that the current HTTP exchange staged ``req_id``: it is released if the
    client leaves before the answer goes out. Not async; outside an exchange, nothing."""
    exchange = _CURRENT.get()
    if exchange is not None:
        exchange.staged = req_id


class ClientWatch(Middleware):
    """ASGI middleware: releases what an exchange staged for a client that left.

    :param service: the encoder service whose backend staged the requests; a release is
        bounded by its ``cleanup_timeout_s``.
    """

    scope_type = "http"

    def __init__(self, app: App, service: _Service) -> None:
        super().__init__(app)
        self._service = service

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = _Exchange()
        token = _CURRENT.set(exchange)

        async def watched_receive() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect" and not exchange.answered:
                exchange.left = True
            return message

        async def watched_send(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # Counted before the write: a client that reads its answer and closes at
                # once must never lose the request it was just told about.
                exchange.answered = True
            await send(message)

        try:
            await self._app(scope, watched_receive, watched_send)
        finally:
            _CURRENT.reset(token)
            backend = self._service.backend  # None: the service closed, releasing everything
            if exchange.staged is not None and exchange.abandoned and backend is not None:
                req_id, timeout_s = exchange.staged, self._service.config.cleanup_timeout_s
                _log.info("req_id %r: its client left before the answer; releasing it", req_id)
                with anyio.CancelScope(shield=True):
                    await release_within(backend, req_id, timeout_s, _log)


async def read_body() -> bytes:
    """The current request's whole body; a checkpoint only when it waits for more.

    Unlike ``request.get_data``, which waits through ``asyncio.wait_for``, a cancellation
    (the client left) is never lost when it arrives with the body's last part.

    :raises RequestTimeout: the body did not arrive within the app's ``BODY_TIMEOUT``.
    :raises RequestEntityTooLarge: over the app's ``MAX_CONTENT_LENGTH``.
    """
    timeout = request.body_timeout
    with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
        data: bytes = await request.body
    if scope.cancelled_caught:
        raise RequestTimeout()
    request.body.clear()  # the caller holds the only copy
    return data
