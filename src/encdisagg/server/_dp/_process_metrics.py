"""The data-parallel workers' CPU time and memory, read by the front from ``/proc``.

The front's own process is covered by ``prometheus_client``'s ``ProcessCollector``
(``process_*``); a worker is another process, so the front reads its ``/proc`` entry for each
scrape and the metrics export it under ``encdisagg_dp_worker_*`` with its ``rank``. Linux only
(elsewhere nothing is read). Reading ``/proc`` costs a few microseconds: done on the event loop.
"""

from __future__ import annotations

import os
from typing import Final

from .._metrics import ProcessStats

__all__ = ["read_process_stats"]

_PAGE_BYTES: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS_PER_S: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_process_stats(pid: int | None, proc: str = "/proc") -> ProcessStats | None:
    """The CPU time (user + system) and resident memory of ``pid``; ``None`` if there is no
    ``pid``, it is gone or this is no Linux. Blocks on one small file read."""
    if pid is None:
        return None
    try:
        with open(f"{proc}/{pid}/stat", "rb") as file:
            stat = file.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat.rpartition(")")[2].split()
    try:
        # utime, stime and rss are fields 14, 15 and 24 of the line (3 is fields[0]).
        utime, stime, rss = int(fields[11]), int(fields[12]), int(fields[21])
    except (IndexError, ValueError):
        return None
    return ProcessStats((utime + stime) / _TICKS_PER_S, rss * _PAGE_BYTES)
