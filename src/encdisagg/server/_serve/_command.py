"""``encdisagg serve``: check the options, bind the port, then load the server and serve.

The flags are declared in ``encdisagg._cli`` and resolved by ``_resolve`` (flags over
``ENCDISAGG_*`` variables over the TOML file), neither of which imports torch: invalid
options exit with status 2 at once, a busy port with status 1 before the model loads. Only
then are the server and the model code imported; each step of the startup is logged.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from .._access import is_loopback_host
from .._asgi._listen import bind_socket
from .._logs import configure_logging
from .._settings import ServerSettings
from ._malloc import return_large_frees_to_the_os
from ._resolve import API_KEY_ENV, ServeOptions, UsageError, resolve
from ._startup import describe_startup_failure

if TYPE_CHECKING:
    from .._service import EncoderService

__all__ = ["ServeOptions", "UsageError", "check_serve", "resolve", "run_serve", "warn_if_exposed"]

_log = logging.getLogger("encdisagg.server")


def warn_if_exposed(host: str, settings: ServerSettings) -> bool:
    """Log a warning if ``host`` is reachable from other machines and no API key is set;
    whether it warned. Not async."""
    if settings.api_key is not None or is_loopback_host(host):
        return False
    _log.warning(
        "serving on %s without an API key: anyone who can reach this port may encode, send "
        "and release any request; set --api-key or %s",
        host,
        API_KEY_ENV,
    )
    return True


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


async def _main(options: ServeOptions, listener: socket.socket) -> int:
    """Serve until a signal; the exit status: 0 after a drain, 128 + the signal's number
    after a second signal stopped it at once."""
    # Imported once the options are valid and the port is ours: these pull torch and the
    # model code, seconds of imports a bad option should not wait for.
    from .._app import create_app
    from .._asgi._runner import serve
    from ._drain import ServeDrain
    from ._registered import ServerRegistration

    config = options.config
    settings = options.settings
    app = create_app(config, settings=settings, flavour=options.worker_class)  # type: ignore[arg-type]
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
        _announce(f"encdisagg serving on {url}", options.log_format, url=url)
        grpc = service.grpc_url
        if grpc is not None:
            _announce(f"encdisagg gRPC serving on {grpc}", options.log_format, grpc_url=grpc)
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
                host=options.host,
                port=options.port,
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


def check_serve(args: argparse.Namespace) -> ServeOptions | int:
    """The options of ``args``, or the exit status after printing why they are invalid
    (2), or after printing them for ``--check`` (0). Imports no torch; not async."""
    try:
        options = resolve(args)
    except UsageError as exc:
        print(f"encdisagg serve: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "check", False):
        print("encdisagg serve: the options are valid")
        for line in options.summary():
            print(f"  {line}")
        return 0
    return options


def _bind(options: ServeOptions) -> socket.socket | None:
    """The listening socket, bound before anything loads (so a busy port answers at once),
    or None after printing why it cannot be bound."""
    try:
        return bind_socket(options.host, options.port)
    except OSError as exc:
        _log.debug("cannot bind", exc_info=exc)
        cause = describe_startup_failure(exc, host=options.host, port=options.port)
        print(f"encdisagg serve: error: {cause}", file=sys.stderr)
        return None


def _json_stderr(log_format: str) -> AbstractContextManager[None]:
    """In JSON mode, native writes to stderr become JSON records too."""
    if log_format != "json":
        return nullcontext()
    from ._stderr_lines import stderr_lines_to_logging

    return stderr_lines_to_logging()


def run_serve(args: argparse.Namespace) -> int:
    """The ``serve`` subcommand: 0 after a graceful shutdown (or a passed ``--check``), 2 for
    invalid options, 1 if the server could not start, 128 + the signal's number when a second
    signal stopped it at once."""
    checked = check_serve(args)
    if isinstance(checked, int):
        return checked
    options = checked
    configure_logging(options.log_level, options.log_format)
    listener = _bind(options)
    if listener is None:
        return 1
    try:
        host, port = listener.getsockname()[:2]
        _log.info("listening on %s:%d; loading the server and the model code", host, port)
        from ._noise import quiet_third_party

        quiet_third_party(options.log_level)
        warn_if_exposed(options.host, options.settings)
        # Before anything large is allocated: freed bodies and images go back to the system.
        return_large_frees_to_the_os()
        try:
            with _json_stderr(options.log_format):
                status = anyio.run(_main, options, listener, backend=options.worker_class)
        except (Exception, BaseExceptionGroup) as exc:
            if isinstance(exc, BaseExceptionGroup) and exc.split(Exception)[0] is None:
                raise  # only KeyboardInterrupt or SystemExit inside: not a startup failure
            _log.debug("the server failed", exc_info=exc)
            cause = describe_startup_failure(exc, host=options.host, port=options.port)
            print(f"encdisagg serve: error: {cause}", file=sys.stderr)
            return 1
        return status
    finally:
        listener.close()  # a no-op once Hypercorn took it over (detached)
