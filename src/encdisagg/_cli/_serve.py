"""``encdisagg serve``: check the options, bind the port, then load the server and serve.

The flags are declared by ``_flag_table`` and resolved by ``_resolve`` (flags over
``ENCDISAGG_*`` variables over the TOML file), neither of which imports torch: invalid
options exit with status 2 at once, a busy port with status 1 before the model loads. Only
then are the server and the model code imported (``server._serve`` serves until a signal);
each step of the startup is logged.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from contextlib import AbstractContextManager, nullcontext

import anyio

from ..server._access import is_loopback_host
from ..server._asgi._listen import bind_socket
from ..server._logs import configure_logging
from ..server._serve._malloc import return_large_frees_to_the_os
from ..server._serve._process import serve_until_signalled
from ..server._serve._startup import describe_startup_failure
from ..server._settings import ServerSettings
from ._resolve import ServeOptions, UsageError, resolve

__all__ = ["ServeOptions", "UsageError", "resolve", "run_serve", "warn_if_exposed"]

_log = logging.getLogger("encdisagg.server")


def warn_if_exposed(host: str, settings: ServerSettings) -> bool:
    """Log a warning if ``host`` is reachable from other machines and no API key is set;
    whether it warned. Not async."""
    if settings.api_key is not None or is_loopback_host(host):
        return False
    _log.warning(
        "serving on %s without an API key: anyone who can reach this port may encode, send "
        "and release any request; set --api-key or ENCDISAGG_API_KEY",
        host,
    )
    return True


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
    from ..server._serve._stderr_lines import stderr_lines_to_logging

    return stderr_lines_to_logging()


def run_serve(args: argparse.Namespace) -> int:
    """The ``serve`` subcommand: 0 after a graceful shutdown (or a passed ``--check``), 2 for
    invalid options, 1 if the server could not start, 128 + the signal's number when a second
    signal stopped it at once."""
    try:
        options = resolve(args)  # imports no torch: invalid options answer at once
    except UsageError as exc:
        print(f"encdisagg serve: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "check", False):
        print("encdisagg serve: the options are valid")
        for line in options.summary():
            print(f"  {line}")
        return 0
    configure_logging(options.log_level, options.log_format)
    listener = _bind(options)
    if listener is None:
        return 1
    try:
        host, port = listener.getsockname()[:2]
        _log.info("listening on %s:%d; loading the server and the model code", host, port)
        from ..server._serve._noise import quiet_third_party

        quiet_third_party(options.log_level)
        warn_if_exposed(options.host, options.settings)
        # Before anything large is allocated: freed bodies and images go back to the system.
        return_large_frees_to_the_os()
        try:
            with _json_stderr(options.log_format):
                status = anyio.run(
                    serve_until_signalled,
                    options.config,
                    options.settings,
                    listener,
                    options.worker_class,
                    options.log_format,
                    backend=options.worker_class,
                )
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
