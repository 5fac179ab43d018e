"""One access line per HTTP request: client address, method, route, status, duration, bytes
in and out, ``req_id``, and the trace id when tracing is on.

An ASGI middleware around the app. It gives each request a fresh
:class:`~.._logs.RequestContext` in the context variable before the app runs, so the routes'
records carry the ``req_id`` they decoded, and logs the line once the response ended (also
when the client went away or the request was cancelled: status 499 then, as nginx does; or
444, "dropped by the server", when the server itself was stopped at once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Any, Final

from .._logs import CURRENT_REQUEST, RequestContext
from ._listen import host_port
from ._middleware import App, Middleware, Receive, Scope, Send

__all__ = ["ACCESS_LOGGER", "AccessLog"]

#: The logger of the access lines (INFO), apart so it can be turned down on its own.
ACCESS_LOGGER: Final = "encdisagg.server.access"
#: The route shown for a path that is none of the app's (the path is the client's text).
_UNMATCHED: Final = "unmatched"
#: Status shown when no response started: the client left, or the server stopped it.
_NO_RESPONSE: Final = 499
#: Status shown when no response started because the server was stopped at once (nginx's
#: "closed without a response").
_DROPPED: Final = 444

_log = logging.getLogger(ACCESS_LOGGER)


class AccessLog(Middleware):
    """ASGI middleware: logs one line per HTTP request to ``encdisagg.server.access``.

    :param routes: the paths logged as themselves; any other is logged as ``unmatched``.
    :param observe: called with each request's route (as logged), status and duration in
        seconds once it ended (the HTTP latency histogram); must not block.
    :param dropped: whether the server is being stopped at once: a request that ends
        without a response then is logged as dropped by the server (444), not 499.
    """

    scope_type = "http"

    def __init__(
        self,
        app: App,
        routes: Collection[str],
        *,
        observe: Callable[[str, int, float], None] | None = None,
        dropped: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(app)
        self._routes = frozenset(routes)
        self._observe = observe
        self._dropped = dropped

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = RequestContext()
        token = CURRENT_REQUEST.set(context)
        status = _NO_RESPONSE
        bytes_in = bytes_out = 0
        started = time.perf_counter()

        async def counted_receive() -> Any:
            nonlocal bytes_in
            message = await receive()
            if message.get("type") == "http.request":
                bytes_in += len(message.get("body", b""))
            return message

        async def watched_send(message: Any) -> None:
            nonlocal status, bytes_out
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                bytes_out += len(message.get("body", b""))
            await send(message)

        try:
            await self._app(scope, counted_receive, watched_send)
        finally:
            seconds = time.perf_counter() - started
            note = ""
            if status == _NO_RESPONSE and self._dropped is not None and self._dropped():
                status, note = _DROPPED, " dropped by the server"
            duration_ms = round(seconds * 1000, 3)
            path = scope.get("path", "")
            route = path if path in self._routes else _UNMATCHED
            if self._observe is not None:
                self._observe(route, status, seconds)
            method = str(scope.get("method", ""))
            client = _address(scope.get("client"))
            trace = f" trace_id={context.trace_id}" if context.trace_id else ""
            _log.info(
                "%s %s %s %s %.1fms in=%d out=%d%s%s",
                client,
                method,
                route,
                status,
                duration_ms,
                bytes_in,
                bytes_out,
                trace,
                note,
                extra={
                    "client": client,
                    "method": method,
                    "route": route,
                    "status": status,
                    "duration_ms": duration_ms,
                    "bytes_in": bytes_in,
                    "bytes_out": bytes_out,
                    "trace_id": context.trace_id,
                },
            )
            CURRENT_REQUEST.reset(token)


def _address(client: object) -> str:
    """``host:port`` of the ASGI ``client`` pair, ``-`` when the server does not know it (a
    Unix socket)."""
    if isinstance(client, (list, tuple)) and len(client) == 2:
        return host_port(str(client[0]), client[1])
    return "-"
