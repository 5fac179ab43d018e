"""The app's lifespan runs inside the encoder service: open first, closed last.

A startup failure is answered with ``lifespan.startup.failed`` carrying the error's message
(the server prints it in one line); the traceback is logged at debug level only. So is an app
served by the other event loop than its class runs on (a Quart app under a Trio worker, a
QuartTrio app under asyncio): such an app starts, then fails every request, so it is refused
before the service opens.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, Protocol

import sniffio

from ...nurseries import leaf_exceptions
from ._middleware import App, Middleware, Receive, Scope, Send

__all__ = ["ServiceLifespan"]

_log = logging.getLogger("encdisagg.server")


class _Service(Protocol):
    def open(self) -> AbstractAsyncContextManager[object]: ...


def _loop_mismatch(expected: str | None) -> str | None:
    """Why the running event loop cannot serve an app built for ``expected``, if it cannot."""
    if expected is None:
        return None
    try:
        running = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None
    if running == expected:
        return None
    built = "a QuartTrio app" if expected == "trio" else "a Quart app"
    other = "hypercorn -k trio" if expected == "trio" else "hypercorn -k asyncio (or uvloop)"
    article = "an" if running[0] in "aeiou" else "a"
    return (
        f"{built} cannot be served by {article} {running} worker: every request would fail; "
        f"serve it with {other}"
    )


class ServiceLifespan(Middleware):
    """ASGI middleware: runs the app's lifespan inside ``service.open()``.

    :param loop: the event loop the app's class runs on (``"asyncio"`` for Quart, ``"trio"``
        for QuartTrio); a server running another fails the startup in one line.
    """

    scope_type = "lifespan"

    def __init__(
        self, app: App, service: _Service, *, loop: Literal["asyncio", "trio"] | None = None
    ) -> None:
        super().__init__(app)
        self._service = service
        self._loop = loop

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        mismatch = _loop_mismatch(self._loop)
        if mismatch is not None:
            _log.error("%s", mismatch)
            await send({"type": "lifespan.startup.failed", "message": f"encdisagg: {mismatch}"})
            return
        try:
            async with self._service.open():
                await self._app(scope, inner_receive, inner_send)
        except Exception as exc:
            # For an exception group, its leaves' messages.
            leaves = "; ".join(str(leaf) or type(leaf).__name__ for leaf in leaf_exceptions(exc))
            message = f"encdisagg: {leaves}"
            if not started:
                # The server reports the message in one line; the traceback is for debugging.
                _log.debug("the encoder service failed to start", exc_info=exc)
                await send({"type": "lifespan.startup.failed", "message": message})
                return
            _log.exception("the encoder service failed")
            final = {"type": "lifespan.shutdown.failed", "message": message}
        await send(final or {"type": "lifespan.shutdown.complete"})
