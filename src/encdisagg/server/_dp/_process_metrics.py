"""Process metrics of the data-parallel workers, read by the front from ``/proc``.

The front's own process is covered by ``prometheus_client``'s ``ProcessCollector``
(``process_*``); a worker is another process, so its CPU time and memory are exported under
``encdisagg_dp_worker_*`` with its ``rank``: each process is counted once, by one collector.
Linux only (elsewhere these families are empty). Reading ``/proc`` costs a few microseconds:
done on the event loop, at scrape time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["ProcessStats", "read_process_stats", "worker_process_families"]

_PAGE_BYTES: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS_PER_S: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class ProcessStats:
    """What ``/proc/PID/stat`` says of one process."""

    cpu_seconds: float
    resident_bytes: int


def read_process_stats(pid: int, proc: str = "/proc") -> ProcessStats | None:
    """The CPU time (user + system) and resident memory of ``pid``; ``None`` if it is gone or
    this is no Linux. Blocks on one small file read."""
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


def worker_process_families(
    workers: Iterable[tuple[int, int | None]], proc: str = "/proc"
) -> Iterator[Metric]:
    """``encdisagg_dp_worker_cpu_seconds`` and ``..._resident_memory_bytes`` for each
    ``(rank, pid)`` whose process is readable. Not async."""
    cpu = CounterMetricFamily(
        "encdisagg_dp_worker_cpu_seconds",
        "User and system CPU time of the data-parallel worker's process.",
        labels=["rank"],
    )
    memory = GaugeMetricFamily(
        "encdisagg_dp_worker_resident_memory_bytes",
        "Resident memory of the data-parallel worker's process.",
        labels=["rank"],
    )
    for rank, pid in workers:
        stats = None if pid is None else read_process_stats(pid, proc)
        if stats is not None:
            cpu.add_metric([str(rank)], stats.cpu_seconds)
            memory.add_metric([str(rank)], stats.resident_bytes)
    yield cpu
    yield memory
