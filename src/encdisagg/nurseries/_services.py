"""Owned background tasks whose failures are always observed."""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, final

import anyio
from anyio.abc import TaskGroup, TaskStatus

__all__ = ["FailurePolicy", "ServiceTaskGroup"]

_log = logging.getLogger("encdisagg.services")


def _task_name(func: object, name: str | None) -> str:
    return name or str(getattr(func, "__qualname__", None) or repr(func))


class FailurePolicy(enum.Enum):
    """What a :class:`ServiceTaskGroup` does when one of its tasks raises."""

    #: Log the failure with its traceback, count it, and keep the other tasks running.
    LOG = "log"
    #: Let it propagate: the group is cancelled and the error leaves ``async with``.
    PROPAGATE = "propagate"


@final
class _ForwardedStatus:
    """The ``task_status`` a task started by :meth:`ServiceTaskGroup.start` gets: forwards
    ``started()`` and remembers that it was called (the policy applies only after it).

    One small object per start, and no closure: the success path leaves no reference cycle
    for the garbage collector.
    """

    __slots__ = ("_status", "reported")

    def __init__(self, status: TaskStatus[Any]) -> None:
        self._status = status
        self.reported = False

    def started(self, value: Any = None) -> None:
        self.reported = True
        self._status.started(value)


class ServiceTaskGroup(anyio.AsyncContextManagerMixin):
    """A task group for long-lived background tasks with an explicit failure policy.

    Every task started here is owned by this group and ends before ``async with`` exits. A
    task's failure is never lost: under :attr:`FailurePolicy.LOG` it is logged with its cause
    (and kept in :attr:`failures`), under :attr:`FailurePolicy.PROPAGATE` it cancels the group
    and is raised. Leaving ``async with`` normally cancels the tasks still running.

    :param name: names the group in logs.
    :param policy: the default failure policy; :meth:`start_soon` may override it per task.
    :param on_failure: called (synchronously) with each failure handled under ``LOG``.
    """

    def __init__(
        self,
        name: str,
        *,
        policy: FailurePolicy = FailurePolicy.LOG,
        on_failure: Callable[[str, BaseException], None] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self._on_failure = on_failure
        self._log = logger or _log
        self._group: TaskGroup | None = None
        #: ``(task name, exception)`` of the latest failures handled under ``LOG``, oldest
        #: first (bounded, so a long-running service does not grow it without limit).
        self.failures: deque[tuple[str, BaseException]] = deque(maxlen=256)
        #: How many failures were handled under ``LOG`` in all.
        self.failure_count = 0

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[ServiceTaskGroup]:
        async with anyio.create_task_group() as group:
            self._group = group
            try:
                yield self
            finally:
                self._group = None
                group.cancel_scope.cancel("service group closing")

    @property
    def cancel_scope(self) -> anyio.CancelScope:
        """The cancel scope of the underlying task group."""
        return self._require_group().cancel_scope

    def _require_group(self) -> TaskGroup:
        if self._group is None:
            raise RuntimeError(f"service group {self.name!r} is not open")
        return self._group

    def start_soon(
        self,
        func: Callable[..., Awaitable[Any]],
        *args: object,
        name: str | None = None,
        policy: FailurePolicy | None = None,
    ) -> None:
        """Start ``func(*args)`` as an owned task. Not a checkpoint."""
        task_name = _task_name(func, name)
        self._require_group().start_soon(
            self._supervise, func, args, task_name, policy or self.policy, name=task_name
        )

    async def start(
        self,
        func: Callable[..., Awaitable[Any]],
        *args: object,
        name: str | None = None,
    ) -> Any:
        """Start ``func(*args, task_status=...)`` and wait until it reports ``started()``.

        A checkpoint. A failure before ``started()`` is raised to the caller; after it, the
        group's policy applies. If the caller is cancelled while waiting, the task is cancelled.
        """
        task_name = _task_name(func, name)
        return await self._require_group().start(
            self._supervise, func, args, task_name, self.policy, name=task_name
        )

    async def _supervise(
        self,
        func: Callable[..., Awaitable[Any]],
        args: tuple[object, ...],
        task_name: str,
        policy: FailurePolicy,
        *,
        task_status: TaskStatus[Any] | None = None,
    ) -> None:
        # Under ``start`` (a ``task_status``), a failure before ``started()`` is the caller's.
        status = None if task_status is None else _ForwardedStatus(task_status)
        try:
            if status is None:
                await func(*args)
            else:
                await func(*args, task_status=status)
        except Exception as exc:
            if policy is FailurePolicy.PROPAGATE or (status is not None and not status.reported):
                raise
            self._record(task_name, exc)

    def _record(self, task_name: str, exc: BaseException) -> None:
        self.failures.append((task_name, exc))
        self.failure_count += 1
        self._log.error("background task %r in %r failed", task_name, self.name, exc_info=exc)
        if self._on_failure is not None:
            self._on_failure(task_name, exc)
