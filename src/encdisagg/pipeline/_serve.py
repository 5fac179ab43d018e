"""Serving an ASGI app (the encoder server) with Hypercorn inside the caller's task group."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import sniffio
from hypercorn.config import Config

__all__ = ["serve_asgi"]

_log = logging.getLogger("encdisagg.pipeline")


@asynccontextmanager
async def serve_asgi(
    app: Any,
    *,
    host: str = "127.0.0.1",
    graceful_timeout_s: float = 5.0,
) -> AsyncIterator[str]:
    """Serve ``app`` with Hypercorn on ``host`` (a free port) for the block; yields its URL.

    Runs on the current backend: ``hypercorn.asyncio`` under asyncio, ``hypercorn.trio``
    under Trio (the app must suit it: a Quart app needs asyncio). The socket is bound and
    listening before the block starts, so the first request can be sent at once; it is
    answered once the app's lifespan startup finished. Leaving the block shuts the server
    down gracefully (requests in flight finish), bounded by ``graceful_timeout_s``, after
    which it is cancelled. Entering is a checkpoint.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    config = Config()
    # Hypercorn takes ownership of the descriptor (and closes it).
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = _log
    config.graceful_timeout = graceful_timeout_s
    shutdown = anyio.Event()
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve  # type: ignore[assignment]

    # Shielded: even when the block raises (which cancels the task group), the server shuts
    # down gracefully through its trigger rather than being torn down mid-request. Its own
    # deadline, set on the way out, bounds that.
    server_scope = anyio.CancelScope(shield=True)

    async def run() -> None:
        with server_scope:
            await serve(app, config, shutdown_trigger=shutdown.wait)

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        try:
            yield f"http://{host}:{port}"
        finally:
            shutdown.set()
            server_scope.deadline = anyio.current_time() + graceful_timeout_s + 1.0
