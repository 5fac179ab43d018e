"""Log records of the server: the ``req_id`` being served on each, text or JSON lines.

The request being served lives in a context variable: the access middleware sets it when a
request arrives (a fresh, mutable :class:`RequestContext`, so the handler can fill in the
``req_id`` once it decoded the body, and the middleware sees it afterwards). Context
variables follow tasks and worker threads on asyncio and Trio alike, so every record logged
while serving a request carries its ``req_id``: :class:`RequestIdFilter` puts it on the
record.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Literal

__all__ = [
    "CURRENT_REQUEST",
    "LogFormat",
    "JsonFormatter",
    "RequestContext",
    "RequestIdFilter",
    "TextFormatter",
    "configure_logging",
    "note_req_id",
    "note_trace_id",
]

LogFormat = Literal["text", "json"]
#: Fields an access record carries (``extra=``); the JSON formatter writes them as keys.
_ACCESS_FIELDS: Final = (
    "client",
    "method",
    "route",
    "status",
    "duration_ms",
    "bytes_in",
    "bytes_out",
    "trace_id",
)


@dataclass(eq=False, slots=True)
class RequestContext:
    """The HTTP request being served in this context."""

    req_id: str | None = None
    #: The request's trace id (32 hex digits) once its server span opened; tracing only.
    trace_id: str | None = None


#: The request this task (or worker thread) serves; ``None`` outside requests.
CURRENT_REQUEST: ContextVar[RequestContext | None] = ContextVar(
    "encdisagg_current_request", default=None
)


def note_req_id(req_id: object) -> None:
    """Remember ``req_id`` (if a string) as the id of the request being served. Not async."""
    context = CURRENT_REQUEST.get()
    if context is not None and isinstance(req_id, str) and context.req_id is None:
        context.req_id = req_id


def note_trace_id(trace_id: str | None) -> None:
    """Remember the trace id of the request being served (its access line shows it). Not
    async."""
    context = CURRENT_REQUEST.get()
    if context is not None and trace_id:
        context.trace_id = trace_id


class RequestIdFilter(logging.Filter):
    """Puts ``req_id`` (the served request's, else ``None``) on every record it passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "req_id", None) is None:
            context = CURRENT_REQUEST.get()
            record.req_id = None if context is None else context.req_id
        return True


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message [req_id=...]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        req_id = getattr(record, "req_id", None)
        return text if req_id is None else f"{text} req_id={json.dumps(req_id)}"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts``, ``level``, ``logger``, ``message``, ``req_id``, the
    access fields when present, ``exc_info`` as text, and ``fields`` (the same on every
    line, such as a worker's rank)."""

    def __init__(self, fields: Mapping[str, object] | None = None) -> None:
        super().__init__()
        self._fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            **self._fields,
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "req_id": getattr(record, "req_id", None),
        }
        for name in _ACCESS_FIELDS:
            if hasattr(record, name):
                line[name] = getattr(record, name)
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(
    level: str, log_format: LogFormat = "text", *, fields: Mapping[str, object] | None = None
) -> None:
    """Send every record at ``level`` and above to stderr as text or JSON lines, each with
    the served request's ``req_id`` (JSON lines also with ``fields``). Replaces the root
    logger's handlers. Not async."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter(fields) if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
