"""How ``encdisagg serve``'s process serves: until a signal, then a drain that loses nothing.

The first SIGINT or SIGTERM turns readiness false, withdraws the registry key
(``_registered``) and drains (``_drain``) before Hypercorn stops accepting; a second one
stops at once, saying what it dropped. The options arrive checked, and the port bound, from
the command line (``encdisagg._cli._serve``).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from ..._config import EncoderConfig
from .._settings import ServerSettings

if TYPE_CHECKING:
    from .._service import EncoderService

__all__ = ["serve_until_signalled"]

_log = logging.getLogger("encdisagg.server")


async def _watch_signals(
    stop: anyio.Event,
    force: anyio.CancelScope,
    stopping_at_once: Callable[[int], Awaitable[None]],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            if not stop.is_set():
                _log.info("got %s: shutting down gracefully", signal.Signals(signum).name)
                stop.set()
            else:
                await stopping_at_once(signum)
                force.cancel()


def _announce(text: str, log_format: str, **fields: str) -> None:
    """A line on stdout for whoever started the server (its URL, once it serves): as it
    reads, or in JSON mode as one JSON object, so both streams parse line by line."""
    if log_format == "json":
        text = json.dumps({"message": text, **fields})
    print(text, flush=True)


async def serve_until_signalled(
    config: EncoderConfig,
    settings: ServerSettings,
    listener: socket.socket,
    flavour: str,
    log_format: str,
) -> int:
    """Serve on ``listener`` (the ``flavour`` app: asyncio or trio) until a signal; the exit
    status: 0 after a drain, 128 + the signal's number after a second signal stopped it at
    once. Runs until then; cancelling it stops the server without a drain."""
    # Imported once the options are valid and the port is ours: these pull torch and the
    # model code, seconds of imports a bad option should not wait for.
    from .._app import create_app
    from .._asgi._runner import serve
    from ._drain import ServeDrain
    from ._registered import ServerRegistration

    app = create_app(config, settings=settings, flavour=flavour)  # type: ignore[arg-type]
    stop = anyio.Event()
    drain_s = config.shutdown_grace_s + config.cleanup_timeout_s
    # Registered once serving; on a drain its key goes first, then Hypercorn drains.
    service: EncoderService = app.extensions["encdisagg"]
    registration = ServerRegistration(settings, config, service)
    drain = ServeDrain(service, delay_s=settings.drain_delay_s, timeout_s=settings.drain_timeout_s)
    forced: list[int] = []

    async def drain_begins() -> None:
        await stop.wait()
        service.start_draining()

    def on_serving(url: str) -> None:
        _announce(f"encdisagg serving on {url}", log_format, url=url)
        grpc = service.grpc_url
        if grpc is not None:
            _announce(f"encdisagg gRPC serving on {grpc}", log_format, grpc_url=grpc)
        registration.on_serving(url)

    async def shut_down() -> None:
        # Readiness false, the registry key withdrawn, then the drain; Hypercorn stops
        # accepting only once this returns.
        await registration.drain_after(drain_begins)
        await drain.settle()

    async def stop_at_once(signum: int) -> None:
        # Counted before anything is cut short, so the line says what this stop loses.
        with anyio.move_on_after(1.0):
            await drain.count()
        service.stopped_at_once = True
        forced.append(signum)
        _log.error(
            "got %s again: stopping now; dropped %s admitted request(s) and any request in "
            "flight (logged as dropped by the server)",
            signal.Signals(signum).name,
            "an unknown number of" if drain.held is None else drain.held,
        )

    if settings.dp > 1:
        _log.info(
            "starting %d data-parallel workers (model %s, transfer %s)",
            settings.dp,
            config.model,
            config.transfer,
        )
    else:
        _log.info("opening the encoder (model %s, transfer %s)", config.model, config.transfer)
    try:
        async with anyio.create_task_group() as group, registration:
            await group.start(_watch_signals, stop, group.cancel_scope, stop_at_once)
            await serve(
                app,
                sock=listener,
                shutdown_trigger=shut_down,
                on_serving=on_serving,
                graceful_timeout_s=config.shutdown_grace_s,
                startup_timeout_s=settings.worker_start_timeout_s + 60.0,
                shutdown_timeout_s=2 * drain_s + 30.0,
            )
            group.cancel_scope.cancel()
    except (Exception, BaseExceptionGroup) as exc:
        if not forced:
            raise
        # Cut short on purpose: what the interrupted server raised is no failure of its own.
        _log.debug("errors of the server stopped at once", exc_info=exc)
    return 128 + forced[0] if forced else 0
