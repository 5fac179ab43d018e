"""Serving an ASGI app (an encoder server) inside the caller's task group."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

__all__ = ["serve_asgi"]


@asynccontextmanager
async def serve_asgi(
    app: Any,
    *,
    host: str = "127.0.0.1",
    graceful_timeout_s: float = 5.0,
    startup_timeout_s: float = 120.0,
    shutdown_timeout_s: float = 30.0,
) -> AsyncIterator[str]:
    """Serve ``app`` with Hypercorn on ``host`` (a free port) for the block; yields its URL.

    Runs on the current backend (:func:`encdisagg.server.serve`): a ``Quart`` app needs
    asyncio, a ``QuartTrio`` app Trio. Entering waits (at most ``startup_timeout_s``) until
    the app's lifespan startup completed, so the server answers from the first request on.
    Leaving shuts it down gracefully, also when the block raised: requests in flight finish
    (``graceful_timeout_s``), then the lifespan shutdown runs; the whole is shielded and
    bounded by the sum of the timeouts, after which the server is cancelled.

    :raises TimeoutError: the startup took longer than ``startup_timeout_s``.
    """
    from ..server import serve

    shutdown = anyio.Event()
    started = anyio.Event()
    urls: list[str] = []

    def on_serving(url: str) -> None:
        urls.append(url)
        started.set()

    # Shielded: when the block raises (which cancels the task group), the server still
    # shuts down through its trigger instead of being torn down mid-request. Its deadline,
    # set on the way out, bounds that.
    server_scope = anyio.CancelScope(shield=True)

    async def run() -> None:
        with server_scope:
            await serve(
                app,
                host=host,
                shutdown_trigger=shutdown.wait,
                on_serving=on_serving,
                graceful_timeout_s=graceful_timeout_s,
                startup_timeout_s=startup_timeout_s,
                shutdown_timeout_s=shutdown_timeout_s,
            )

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        try:
            with anyio.fail_after(startup_timeout_s):
                await started.wait()
            yield urls[0]
        finally:
            shutdown.set()
            server_scope.deadline = (
                anyio.current_time() + graceful_timeout_s + shutdown_timeout_s + 1.0
            )
