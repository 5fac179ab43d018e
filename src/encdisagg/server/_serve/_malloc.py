"""Keeping a server's resident memory close to what it uses: glibc's mmap threshold.

glibc serves a large ``malloc`` (128 KiB and up) with its own ``mmap``, returned to the
system on ``free``, until the first such block is freed: it then raises the threshold to
that block's size (up to 32 MiB), and later blocks of that size come from its heaps, which
give freed memory back only from their top. A server that decodes megabyte bodies and
images in many threads, all of different lifetimes, thus keeps most of what it ever held:
under 200 concurrent 1280x720 encodes, about 900 MiB beyond what it used. Fixing the
threshold at glibc's own initial value turns that dynamic rule off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD_BYTES", "return_large_frees_to_the_os"]

_log = logging.getLogger("encdisagg.server")

#: glibc's initial (and documented default) threshold.
MMAP_THRESHOLD_BYTES = 128 * 1024
#: The environment variable glibc reads at start; worker processes inherit it.
_ENV = "MALLOC_MMAP_THRESHOLD_"
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h


def return_large_frees_to_the_os() -> bool:
    """Fix glibc's mmap threshold for this process and the processes it starts, unless the
    environment sets it already; whether it did. Not async; does nothing off glibc."""
    if _ENV in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    os.environ[_ENV] = str(MMAP_THRESHOLD_BYTES)  # for workers started from here
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        _log.debug("mallopt(M_MMAP_THRESHOLD) refused; glibc keeps its dynamic threshold")
        return False
    return True
