"""Serving an app with Hypercorn on the running event loop (asyncio or Trio).

:func:`serve` binds the listening socket itself (so port 0 yields the real port before
Hypercorn starts), hands it to Hypercorn as ``fd://``, and reports the URL once the app's
lifespan startup completed. Shutdown is the caller's ``shutdown_trigger``; Hypercorn then
stops accepting, lets requests in flight finish within ``graceful_timeout_s``, and runs the
lifespan shutdown (which closes the Encoder).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
import anyio.abc
import sniffio
from hypercorn.config import Config as HypercornConfig

from ._eof_close import install_eof_close
from ._listen import bind_socket, host_port
from ._middleware import App, Middleware, Receive, Scope, Send
from ._read_turns import install_read_turns, read_turns_from_env

__all__ = ["serve"]

_log = logging.getLogger("encdisagg.server")


def _drop_running_on(record: logging.LogRecord) -> bool:
    # Hypercorn says "Running on URL" before the app's startup ran, also when it then fails;
    # on_serving announces the URL once the app really serves.
    return not str(record.msg).startswith("Running on")


class _WatchStartup(Middleware):
    """ASGI middleware that calls ``on_started`` once the lifespan startup completed."""

    scope_type = "lifespan"

    def __init__(self, app: App, on_started: Callable[[], None]):
        super().__init__(app)
        self._on_started = on_started

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watched_send(message: Any) -> None:
            await send(message)
            if message["type"] == "lifespan.startup.complete":
                self._on_started()

        await self._app(scope, receive, watched_send)


async def serve(
    app: Callable[..., Awaitable[None]],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    on_serving: Callable[[str], None] | None = None,
    graceful_timeout_s: float = 30.0,
    startup_timeout_s: float = 600.0,
    shutdown_timeout_s: float = 120.0,
    keep_alive_timeout_s: float = 75.0,
    sock: socket.socket | None = None,
    read_turns: int | None = None,
) -> None:
    """Serve ``app`` with Hypercorn until ``shutdown_trigger`` returns, then shut down.

    A checkpoint; returns once the server and the app's lifespan shut down. Runs on the
    current event loop: a ``Quart`` app needs asyncio, a ``QuartTrio`` app needs Trio.
    ``on_serving(url)`` is called once the lifespan startup completed (the socket already
    listens, so clients may connect from then on). Cancelling the call stops the server
    without the graceful drain.

    :param keep_alive_timeout_s: how long an idle keep-alive connection stays open. Longer
        than the clients' own idle expiry (httpx: 5 s, aiohttp: 15 s), so a client never
        sends a request on a connection the server is closing at that moment.
    :param sock: a listening socket to serve on instead of binding ``host:port``; it is
        handed to Hypercorn, which closes it.
    :param read_turns: under Trio, how many connections streaming a request body read at
        once (``0``: each whenever its socket has data, as Hypercorn does); ``None``: from
        ``ENCDISAGG_TRIO_READ_TURNS``, default 4. Keeps probes answered under many uploads
        (see ``_read_turns``); asyncio ignores it.
    :raises OSError: if the address cannot be bound.
    :raises hypercorn.utils.LifespanFailureError: if the app's startup failed.
    """
    # Without it, a connection its client closed stays open until the keep-alive expires.
    install_eof_close()
    listener = sock if sock is not None else bind_socket(host, port)
    url = "http://" + host_port(*listener.getsockname()[:2])
    config = HypercornConfig()
    # Hypercorn takes the descriptor over (and closes it); detach so nobody closes it twice.
    config.bind = [f"fd://{listener.detach()}"]
    config.graceful_timeout = graceful_timeout_s
    config.startup_timeout = startup_timeout_s
    config.shutdown_timeout = shutdown_timeout_s
    config.keep_alive_timeout = keep_alive_timeout_s
    config.accesslog = None
    error_log = logging.getLogger("hypercorn.error")
    if _drop_running_on not in error_log.filters:
        error_log.addFilter(_drop_running_on)
    config.errorlog = error_log

    started = anyio.Event()
    wrapped = _WatchStartup(app, started.set)

    async def announce() -> None:
        await started.wait()
        if on_serving is not None:
            on_serving(url)

    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as hypercorn_serve

        turns = read_turns_from_env() if read_turns is None else read_turns
        install_read_turns(config, turns)
    else:
        from hypercorn.asyncio import serve as hypercorn_serve  # type: ignore[assignment]

    async def run_server(group: anyio.abc.TaskGroup) -> None:
        await hypercorn_serve(
            cast(Any, wrapped), config, shutdown_trigger=shutdown_trigger, mode="asgi"
        )
        group.cancel_scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(announce)
        # In a task of its own: hypercorn.asyncio's serve leaves its task with an unmatched
        # cancellation request (Task.cancelling() stays 1), which would make an enclosing
        # cancel scope in the same task mistake its own cancellation for a foreign one.
        group.start_soon(run_server, group)
