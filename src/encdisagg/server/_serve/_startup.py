"""One line naming why ``encdisagg serve`` could not start.

A failure during startup reaches the command wrapped in task-group exception groups (the
serving task group, Hypercorn's, AnyIO's), or as Hypercorn's lifespan failure that carries
only the app's message. A user needs the root cause: the busy port, the missing file. This
module digs it out; the full traceback stays at debug level.
"""

from __future__ import annotations

import errno
import re
import socket
from typing import Final

from ..._errors import EncdisaggError
from ...nurseries import leaf_exceptions
from .._asgi._listen import host_port

__all__ = ["describe_startup_failure"]

#: Hypercorn's ``LifespanFailureError`` keeps only this text; the message the app sent is
#: quoted inside it.
_LIFESPAN_FAILURE: Final = re.compile(r"^Lifespan failure in (?:startup|shutdown)\. '(.*)'$", re.S)
#: The prefix the app's lifespan puts before its message.
_APP_PREFIX: Final = "encdisagg: "


def _is_cancellation(exc: BaseException) -> bool:
    # Not imported: the command may run on either backend, and Trio may be absent.
    kind = type(exc)
    return kind.__name__ in ("CancelledError", "Cancelled") and kind.__module__.split(".")[0] in (
        "asyncio",
        "trio",
        "concurrent",
    )


def _describe_os_error(exc: OSError, host: str | None, port: int | None) -> str:
    if host is None or port is None:
        return str(exc)
    address = host_port(host, port)
    if isinstance(exc, socket.gaierror):
        return f"cannot serve on {address}: unknown host {host!r}"
    if exc.errno == errno.EADDRINUSE:
        return f"{address} is already in use"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot serve on {address}: that address is not one of this machine's"
    if exc.errno == errno.EACCES:
        return f"cannot serve on {address}: permission denied (ports below 1024 need privileges)"
    return f"cannot serve on {address}: {exc.strerror or exc}"


def _describe_leaf(exc: BaseException, host: str | None, port: int | None) -> str:
    if isinstance(exc, EncdisaggError):
        return exc.message
    if isinstance(exc, OSError):
        return _describe_os_error(exc, host, port)
    match = _LIFESPAN_FAILURE.match(str(exc))
    if match is not None:
        message = match.group(1)
        return message.removeprefix(_APP_PREFIX) or "the app failed to start"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe_startup_failure(
    exc: BaseException, *, host: str | None = None, port: int | None = None
) -> str:
    """One line naming the root cause of ``exc``, a failure while starting (to serve on
    ``host:port``, when given): ``"127.0.0.1:8000 is already in use"``, the model's error.

    Exception groups are unwrapped (distinct causes are joined with ``"; "``); no
    task-group wording remains. Not async.
    """
    causes: list[str] = []
    # The cancellations a failing sibling caused are no cause.
    leaves = [leaf for leaf in leaf_exceptions(exc) if not _is_cancellation(leaf)]
    for leaf in leaves or [exc]:
        cause = " ".join(_describe_leaf(leaf, host, port).split())
        if cause not in causes:
            causes.append(cause)
    return "; ".join(causes)
