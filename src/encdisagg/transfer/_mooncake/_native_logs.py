"""Mooncake's own log lines (glog, written straight to file descriptor 2), kept quiet.

Starting a Mooncake engine prints about ten glog lines, an ``E`` line among them ("Local
segment descriptor not found") that every first start prints and that is no error. Two
measures, both skipped when the user set ``MC_LOG_LEVEL`` (then Mooncake prints what they
asked for):

- :func:`quiet_mooncake_by_default` sets ``MC_LOG_LEVEL`` (Mooncake's own knob, read once
  when its library loads) to ``WARNING``, or leaves it at Mooncake's ``INFO`` when debug
  logging is on, so running engines print only warnings and errors;
- :func:`native_lines_to_logging` redirects descriptor 2 into a temporary file while an
  engine starts and re-logs each captured glog line through Python's logging: at debug level
  when the start succeeded, at its own level when it failed (so the cause stands next to the
  error). Lines that are not glog's (another thread's, written meanwhile) are written back
  to descriptor 2 unchanged. At most :data:`MAX_CAPTURED_BYTES` are read back.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Final

__all__ = [
    "MAX_CAPTURED_BYTES",
    "NATIVE_LOGGER",
    "glog_level",
    "native_lines_to_logging",
    "quiet_mooncake_by_default",
    "relog_native_lines",
]

#: The logger the captured lines go to.
NATIVE_LOGGER: Final = "encdisagg.transfer.mooncake_native"
#: Most bytes of captured output read back (an engine start writes about 1 KiB).
MAX_CAPTURED_BYTES: Final = 256 * 1024
_LEVEL_ENV: Final = "MC_LOG_LEVEL"
# ``I1201 14:04:37.497501 23460 transfer_engine_impl.cpp:1046] message``
_GLOG_LINE: Final = re.compile(r"([IWEF])\d{4} [\d:.]+\s+\d+ ([^\]\s]+)\] ?(.*)")
_GLOG_LEVELS: Final = {
    "I": logging.INFO,
    "W": logging.WARNING,
    "E": logging.ERROR,
    "F": logging.CRITICAL,
}
#: glog's notice that nobody called ``InitGoogleLogging`` (Mooncake never does).
_GLOG_PREAMBLE: Final = "WARNING: Logging before InitGoogleLogging()"
# One redirection at a time: descriptor 2 is the process's.
_redirecting = threading.Lock()
#: Set beside MC_LOG_LEVEL when the level is ours, not the user's (an environment
#: variable, so data-parallel workers, which inherit both, know it too).
_OURS_ENV: Final = "ENCDISAGG_MC_LOG_LEVEL_DEFAULTED"

_log = logging.getLogger(NATIVE_LOGGER)


def quiet_mooncake_by_default(debug: bool | None = None) -> None:
    """Set ``MC_LOG_LEVEL`` to ``WARNING`` unless it is set or ``debug`` (default: whether
    this module's logger logs debug records). Only takes effect before Mooncake's library is
    first imported. Not async."""
    if debug is None:
        debug = _log.isEnabledFor(logging.DEBUG)
    if _LEVEL_ENV not in os.environ and not debug:
        os.environ[_LEVEL_ENV] = "WARNING"
        os.environ[_OURS_ENV] = "1"


def _user_chose_a_level() -> bool:
    return _LEVEL_ENV in os.environ and _OURS_ENV not in os.environ


def glog_level(line: str) -> int | None:
    """The logging level of a glog line (its preamble: debug), ``None`` for other text."""
    match = _GLOG_LINE.fullmatch(line)
    if match is not None:
        return _GLOG_LEVELS[match[1]]
    return logging.DEBUG if line.startswith(_GLOG_PREAMBLE) else None


def relog_native_lines(text: str, *, failed: bool) -> str:
    """Log each glog line of ``text`` (see the module docstring); the rest, unchanged. Not
    async."""
    others = []
    for line in text.splitlines(keepends=True):
        stripped = line.rstrip("\r\n")
        match = _GLOG_LINE.fullmatch(stripped)
        if match is not None:
            level = _GLOG_LEVELS[match[1]] if failed else logging.DEBUG
            _log.log(level, "mooncake %s %s: %s", match[1], match[2], match[3])
        elif stripped.startswith(_GLOG_PREAMBLE):
            _log.debug("mooncake: %s", stripped)
        elif stripped:
            others.append(line)
    return "".join(others)


@contextmanager
def native_lines_to_logging() -> Iterator[None]:
    """Capture descriptor 2 for the block and re-log what Mooncake wrote there. Blocks
    (run it in a worker thread, around the blocking engine start). With ``MC_LOG_LEVEL``
    set by the user, or where descriptor 2 cannot be duplicated, it captures nothing."""
    if _user_chose_a_level() or not _redirecting.acquire(blocking=False):
        yield
        return
    failed = True
    try:
        with tempfile.TemporaryFile() as captured:
            try:
                sys.stderr.flush()
                saved = os.dup(2)
            except (OSError, ValueError):
                yield
                failed = False
                return
            os.dup2(captured.fileno(), 2)
            try:
                yield
                failed = False
            finally:
                with suppress(OSError, ValueError):
                    sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                text = captured.read(MAX_CAPTURED_BYTES).decode("utf-8", "replace")
                rest = relog_native_lines(text, failed=failed)
                if rest:
                    os.write(2, rest.encode("utf-8", "replace"))
    finally:
        _redirecting.release()
