"""Jobs: the only way work may touch a request's staged memory.

A :class:`Job` is counted into its request's record when it is made and out when its
``with`` block ends; the record is freed by whichever job leaves last after release was
asked for, so no job can see the memory go. A job costs no cancel scope while it does not
wait: the request's deadline or the Encoder's shutdown cancels it through
:meth:`Job.waiting`, the scope each of its waits runs in, and a job cancelled between two
waits is stopped at its next one. A job whose wait was cut short raises :class:`CutShort`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import anyio

from ._table import RequestRecord

__all__ = ["CutShort", "Job"]


class CutShort(Exception):
    """A wait inside a job was cancelled by the request's deadline or the shutdown."""


class Job:
    """One piece of work on a request's memory.

    :param record: the request.
    :param free: called (synchronously) when this job's exit makes the record freeable.
    """

    __slots__ = ("_free", "_scope", "cancelled", "record")

    def __init__(self, record: RequestRecord, free: Callable[[RequestRecord], None]) -> None:
        self.record = record
        self._free = free
        self._scope: anyio.CancelScope | None = None
        self.cancelled = False
        record.enter(self)

    def cancel(self) -> None:
        """Stop the job at its current or next wait. Not a checkpoint."""
        self.cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    def waiting(self) -> _Wait:
        """A ``with`` block for one wait of the job (a checkpoint may happen inside it).

        :raises CutShort: on leaving it, if the job was cancelled.
        """
        return _Wait(self)

    def __enter__(self) -> Job:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.leave(failed=exc is not None)

    def leave(self, *, failed: bool = False) -> None:
        """Count the job out (also for a job that never ran). Not a checkpoint."""
        record = self.record
        if failed:
            # A failed or cancelled job releases its request.
            record.release_requested = True
        if record.leave(self):
            self._free(record)


class _Wait:
    __slots__ = ("_job", "_scope")

    def __init__(self, job: Job) -> None:
        self._job = job
        self._scope = anyio.CancelScope()

    def __enter__(self) -> None:
        job, scope = self._job, self._scope
        job._scope = scope
        if job.cancelled:
            scope.cancel()
        scope.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        scope = self._scope
        self._job._scope = None
        swallowed = bool(scope.__exit__(exc_type, exc, tb))
        if scope.cancelled_caught:
            raise CutShort
        return swallowed
