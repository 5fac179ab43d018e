"""In JSON log mode, every line on the process's stderr is JSON: native writes included.

Native libraries (Mooncake's glog, libzmq, CUDA) write straight to file descriptor 2, past
Python's logging. :func:`stderr_lines_to_logging` points descriptor 2 at a pipe for as long as
the server runs and moves the log handlers to the real stderr; a thread reads the pipe line by
line and logs each line as a record (a glog line at its own level, under the native logger;
any other text at WARNING under ``encdisagg.stderr``). A line that is a JSON object already (a
data-parallel worker's record: workers inherit descriptor 2) is passed through unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, TextIO

from ...transfer._mooncake._native_logs import NATIVE_LOGGER, glog_level

__all__ = ["STDERR_LOGGER", "stderr_lines_to_logging"]

#: The logger of stderr lines that are not glog's.
STDERR_LOGGER: Final = "encdisagg.stderr"
#: Longest line kept whole; a longer one is logged in pieces.
_MAX_LINE_BYTES: Final = 64 * 1024
#: Bound on waiting for the reader to log what was written before the server stopped.
_DRAIN_S: Final = 2.0


@contextmanager
def stderr_lines_to_logging() -> Iterator[None]:
    """Within the block, what anything writes to descriptor 2 becomes log records.

    Not async; the block may run an event loop. Leaving it puts descriptor 2 back and waits
    (at most two seconds) for the reader to log the last lines.
    """
    sys.stderr.flush()
    real = os.dup(2)
    stream = os.fdopen(real, "w", buffering=1, encoding="utf-8", errors="replace")
    moved = _retarget_handlers(sys.stderr, stream)
    previous, sys.stderr = sys.stderr, stream
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    reader = threading.Thread(
        target=_relog_lines, args=(read_end, stream), name="encdisagg-stderr", daemon=True
    )
    reader.start()
    try:
        yield
    finally:
        # The pipe's last writer goes (unless a child still holds it): the reader ends.
        os.dup2(real, 2)
        reader.join(_DRAIN_S)
        sys.stderr = previous
        _retarget_handlers(stream, previous, only=moved)
        if not reader.is_alive():
            os.close(read_end)
            stream.close()


def _retarget_handlers(
    old: TextIO, new: TextIO, *, only: list[logging.StreamHandler[TextIO]] | None = None
) -> list[logging.StreamHandler[TextIO]]:
    moved = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and (
            handler in only if only is not None else handler.stream is old
        ):
            handler.setStream(new)
            moved.append(handler)
    return moved


def _relog_lines(read_end: int, passthrough: TextIO) -> None:
    pending = b""
    while True:
        chunk = os.read(read_end, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > _MAX_LINE_BYTES:
            lines.append(pending)
            pending = b""
        for line in lines:
            relog_line(line.decode("utf-8", "replace"), passthrough)
    if pending:
        relog_line(pending.decode("utf-8", "replace"), passthrough)


def relog_line(text: str, passthrough: TextIO) -> None:
    """One line read from descriptor 2, as a record (or as it is, if it is JSON already)."""
    stripped = text.strip()
    if not stripped:
        return
    if stripped.startswith("{"):
        try:
            is_record = isinstance(json.loads(stripped), dict)
        except ValueError:
            is_record = False
        if is_record:
            passthrough.write(stripped + "\n")
            return
    level = glog_level(stripped)
    if level is not None:
        logging.getLogger(NATIVE_LOGGER).log(level, "%s", stripped)
    else:
        logging.getLogger(STDERR_LOGGER).warning("%s", stripped)
