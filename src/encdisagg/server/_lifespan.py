"""The app's lifespan runs inside the encoder service: open first, closed last.

A startup failure is answered with ``lifespan.startup.failed`` carrying the error's message
(the server prints it in one line); the traceback is logged at debug level only.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

__all__ = ["ServiceLifespan"]

_log = logging.getLogger("encdisagg.server")


class _Service(Protocol):
    def open(self) -> AbstractAsyncContextManager[object]: ...


def _describe(exc: BaseException) -> str:
    """``exc``'s message; for an exception group, its leaves' messages."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(inner) for inner in exc.exceptions)
    return str(exc) or type(exc).__name__


class ServiceLifespan:
    """ASGI middleware: runs the app's lifespan inside ``service.open()``."""

    def __init__(self, app: Callable[..., Awaitable[None]], service: _Service) -> None:
        self._app = app
        self._service = service

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] != "lifespan":
            await self._app(scope, receive, send)
            return
        first = await receive()
        replay = [first]
        started = False
        final: dict[str, Any] | None = None

        async def inner_receive() -> Any:
            if replay:
                return replay.pop()
            return await receive()

        async def inner_send(message: Any) -> None:
            nonlocal started, final
            kind = message["type"]
            if kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                # Held back until the service is closed.
                final = message
                return
            if kind == "lifespan.startup.complete":
                started = True
            await send(message)

        if first["type"] != "lifespan.startup":
            await self._app(scope, inner_receive, send)
            return
        try:
            async with self._service.open():
                await self._app(scope, inner_receive, inner_send)
        except Exception as exc:
            message = f"encdisagg: {_describe(exc)}"
            if not started:
                # The server reports the message in one line; the traceback is for debugging.
                _log.debug("the encoder service failed to start", exc_info=exc)
                await send({"type": "lifespan.startup.failed", "message": message})
                return
            _log.exception("the encoder service failed")
            final = {"type": "lifespan.shutdown.failed", "message": message}
        await send(final or {"type": "lifespan.shutdown.complete"})
