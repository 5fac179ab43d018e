"""Liveness and readiness: the two questions ``/health`` answers as one.

``/health/live`` asks whether the process serves at all (restart it if not);
``/health/ready`` asks whether traffic should come here: the model is loaded, no drain has
begun, and (data parallel) at least ``ready_min_workers`` workers serve. Both are decisions
on state the service keeps; neither runs a probe encode (``/health`` still does).
"""

from __future__ import annotations

from ._backend import Backend
from ._dp._front import DataParallelBackend

__all__ = ["readiness_problem"]


def readiness_problem(backend: Backend | None, *, draining: bool) -> str | None:
    """Why the service should get no traffic now, or ``None`` if it is ready. Not async.

    Data parallel: ready while at least ``settings.ready_min_workers`` workers serve (all of
    them when there are fewer); a worker being restarted does not serve.
    """
    if draining:
        return "not ready: the server is draining"
    if backend is None:
        return "not ready: the model is not loaded"
    if isinstance(backend, DataParallelBackend):
        statuses = backend.workers
        down = [status.rank for status in statuses if not status.alive]
        needed = min(backend.settings.ready_min_workers, len(statuses))
        if len(statuses) - len(down) < needed:
            ranks = ", ".join(str(rank) for rank in down)
            workers = "worker" if len(down) == 1 else "workers"
            return (
                f"not ready: data-parallel {workers} {ranks} down "
                f"({len(statuses) - len(down)} of {len(statuses)} serve; {needed} needed)"
            )
    return None
