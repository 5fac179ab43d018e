"""Scopes that own a resource and release it only after all their work has ended.

An :class:`OwningScope` is a task group plus one resource. The resource is acquired when the
scope starts and released exactly once when the scope ends, and the scope can only end after
every task started inside it has returned. So a task that reads or writes the resource can
never see it released underneath it: *drain before release* follows from the nesting.

The scope runs as a task of some longer-lived owner (``await owner.start(scope.run)``), or
directly around a block of code with :func:`open_owning_scope`.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

__all__ = [
    "OwningScope",
    "ReleaseFailedError",
    "ScopeClosedError",
    "ScopeState",
    "open_owning_scope",
]

T = TypeVar("T")
R = TypeVar("R")

_log = logging.getLogger("encdisagg.nurseries")


class ScopeClosedError(RuntimeError):
    """The scope no longer accepts work: it is winding down, expired, or closed."""


class ReleaseFailedError(RuntimeError):
    """Releasing a scope's resource failed or timed out; ``__cause__`` holds why."""


class ScopeState(enum.Enum):
    """Where an :class:`OwningScope` is in its life. It only moves forward."""

    #: Created, not started.
    NEW = "new"
    #: Acquiring its resource.
    ACQUIRING = "acquiring"
    #: Accepting work.
    OPEN = "open"
    #: Refusing new work; waiting for the work in flight to end.
    WINDING_DOWN = "winding_down"
    #: All work ended; releasing the resource.
    RELEASING = "releasing"
    #: Released (or the release failed, which was reported). Nothing of it is left.
    CLOSED = "closed"


@dataclass(eq=False, slots=True)
class _CallOutcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None
    finished: bool = False


class OwningScope(Generic[T]):
    """A task group that owns one resource.

    :param acquire: awaited when the scope starts; its result is :attr:`resource`.
    :param release: awaited exactly once when the scope ends, after every task inside it
        returned, shielded from cancellation and bounded by ``cleanup_timeout``.
    :param name: names the scope in errors and logs.
    :param cleanup_timeout: bound on ``release``.
    :param deadline: absolute time (``anyio.current_time()`` clock) at which the scope cancels
        the work still inside it and releases; ``math.inf`` for none. Can be moved later.

    Ways to end a scope, all synchronous: :meth:`wind_down` (no new work; work in flight
    finishes), :meth:`cancel` (work in flight is cancelled; its shielded parts still
    complete), or reaching :attr:`deadline` (same as ``cancel``).

    If the work inside raised, that error leaves :meth:`run`; a release that fails then is
    logged and attached to it as a note. If only the release failed, :meth:`run` raises
    :class:`ReleaseFailedError` with the cause.
    """

    def __init__(
        self,
        acquire: Callable[[], Awaitable[T]],
        release: Callable[[T], Awaitable[None]],
        *,
        name: str = "scope",
        cleanup_timeout: float = 10.0,
        deadline: float = math.inf,
    ) -> None:
        self.name = name
        self._acquire = acquire
        self._release = release
        self._cleanup_timeout = cleanup_timeout
        self._deadline = deadline
        self._state = ScopeState.NEW
        self._resource: T | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._wind_down_requested = anyio.Event()
        self._closed = anyio.Event()
        # Tasks started in the group and not yet returned. Lets owners see "idle" without
        # reaching into the task group.
        self._active_tasks = 0
        self._cancel_requested = False
        self._started = False
        self._expired = False

    # -- decisions: synchronous, never checkpoint ------------------------------------------

    @property
    def state(self) -> ScopeState:
        return self._state

    @property
    def accepting(self) -> bool:
        """Whether new work is accepted right now."""
        return self._state is ScopeState.OPEN and anyio.current_time() < self._deadline

    @property
    def expired(self) -> bool:
        """Whether the deadline passed while the scope still held its work."""
        if self._state in (ScopeState.OPEN, ScopeState.WINDING_DOWN):
            return not self._cancel_requested and anyio.current_time() >= self._deadline
        return self._expired

    @property
    def active_tasks(self) -> int:
        """How many tasks started inside the scope have not returned yet."""
        return self._active_tasks

    @property
    def resource(self) -> T:
        """The owned resource; readable while the scope is open or winding down."""
        if self._state not in (ScopeState.OPEN, ScopeState.WINDING_DOWN):
            raise ScopeClosedError(f"{self.name} holds no resource ({self._state.value})")
        return self._resource  # type: ignore[return-value]

    @property
    def deadline(self) -> float:
        return self._deadline

    @deadline.setter
    def deadline(self, value: float) -> None:
        self._deadline = value
        if self._group is not None:
            self._group.cancel_scope.deadline = value

    def wind_down(self) -> None:
        """Stop accepting work; the scope ends once the work in flight has returned.

        Idempotent. Not a checkpoint.
        """
        if self._state in (ScopeState.NEW, ScopeState.ACQUIRING, ScopeState.OPEN):
            self._state = ScopeState.WINDING_DOWN
        self._wind_down_requested.set()

    def cancel(self) -> None:
        """Wind down and cancel the work in flight (shielded parts still complete)."""
        self.wind_down()
        self._cancel_requested = True
        if self._group is not None:
            self._group.cancel_scope.cancel(f"{self.name} cancelled")

    def _require_open(self) -> anyio.abc.TaskGroup:
        if not self.accepting or self._group is None:
            state = "expired" if self._state is ScopeState.OPEN else self._state.value
            raise ScopeClosedError(f"{self.name} accepts no new work ({state})")
        return self._group

    # -- work inside the scope ---------------------------------------------------------------

    def start_soon(self, func: Callable[..., Awaitable[Any]], *args: object) -> None:
        """Start ``func(*args)`` as a task owned by the scope. Not a checkpoint.

        An exception from the task cancels the scope's other work and leaves :meth:`run`.

        :raises ScopeClosedError: if the scope no longer accepts work.
        """
        group = self._require_open()
        group.start_soon(self._tracked, func, args)

    async def _tracked(self, func: Callable[..., Awaitable[Any]], args: tuple[object, ...]) -> None:
        self._active_tasks += 1
        try:
            await func(*args)
        finally:
            self._active_tasks -= 1

    async def call(self, func: Callable[..., Awaitable[R]], *args: object) -> R:
        """Run ``func(*args)`` inside the scope and wait for its result.

        This is a checkpoint. ``func`` runs as a task of the scope, so the resource outlives
        it. Its result or exception is returned or raised here, and does not disturb the
        scope. If the caller is cancelled, ``func`` is cancelled too, and the caller returns
        only after ``func`` has returned (its shielded parts complete first).

        :raises ScopeClosedError: if the scope does not accept work, or ended (deadline or
            :meth:`cancel`) before ``func`` returned.
        """
        group = self._require_open()
        outcome: _CallOutcome[R] = _CallOutcome()
        done = anyio.Event()
        call_scope = anyio.CancelScope()

        async def child() -> None:
            self._active_tasks += 1
            try:
                with call_scope:
                    try:
                        outcome.value = await func(*args)
                        outcome.finished = True
                    except Exception as exc:
                        outcome.error = exc
            finally:
                self._active_tasks -= 1
                done.set()

        group.start_soon(child)
        try:
            await done.wait()
        except BaseException:
            # The caller is leaving (cancelled): stop the child, and do not return before it
            # has stopped touching the scope's resource.
            call_scope.cancel()
            with anyio.CancelScope(shield=True):
                await done.wait()
            raise
        if outcome.error is not None:
            raise outcome.error
        if not outcome.finished:
            raise ScopeClosedError(f"{self.name} ended before the call returned")
        return outcome.value  # type: ignore[return-value]

    # -- the scope's own task ----------------------------------------------------------------

    async def run(
        self,
        *,
        task_status: anyio.abc.TaskStatus[OwningScope[T]] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Acquire, serve work until wound down, cancelled or expired, then release.

        Meant to be started by an owner: ``scope = await owner.start(scope.run)``; the owner
        gets the scope back once the resource is acquired. Runs only once.
        """
        if self._started:
            raise RuntimeError(f"{self.name} was already started")
        self._started = True
        if self._state is ScopeState.NEW:
            self._state = ScopeState.ACQUIRING
        try:
            self._resource = await self._acquire()
        except BaseException:
            self._state = ScopeState.CLOSED
            self._closed.set()
            raise
        try:
            async with anyio.create_task_group() as group:
                group.cancel_scope.deadline = self._deadline
                if self._cancel_requested:
                    group.cancel_scope.cancel(f"{self.name} cancelled")
                self._group = group
                if self._state is ScopeState.ACQUIRING:
                    self._state = ScopeState.OPEN
                task_status.started(self)
                await self._wind_down_requested.wait()
                self._state = ScopeState.WINDING_DOWN
            # Reached only when the group is done: every task inside it has returned.
            self._expired = group.cancel_scope.cancelled_caught and not self._cancel_requested
        except BaseException as exc:
            self._state = ScopeState.RELEASING
            await self._release_once(exc)
            raise
        else:
            self._state = ScopeState.RELEASING
            await self._release_once(None)
        finally:
            self._group = None
            self._resource = None
            self._state = ScopeState.CLOSED
            self._closed.set()

    async def _release_once(self, original: BaseException | None) -> None:
        resource = self._resource
        failure: BaseException | None = None
        with anyio.move_on_after(self._cleanup_timeout, shield=True) as bound:
            try:
                await self._release(resource)  # type: ignore[arg-type]
            except Exception as exc:
                failure = exc
        if bound.cancelled_caught and failure is None:
            failure = TimeoutError(
                f"releasing {self.name} took longer than {self._cleanup_timeout} s"
            )
        if failure is None:
            return
        if original is not None:
            _log.error(
                "releasing %s failed while it was ending with %r",
                self.name,
                original,
                exc_info=failure,
            )
            original.add_note(f"while ending, releasing {self.name} also failed: {failure!r}")
            return
        raise ReleaseFailedError(f"releasing {self.name} failed: {failure}") from failure

    async def wait_closed(self) -> None:
        """Wait until the resource has been released (or its release failed). A checkpoint."""
        await self._closed.wait()


@asynccontextmanager
async def open_owning_scope(
    acquire: Callable[[], Awaitable[T]],
    release: Callable[[T], Awaitable[None]],
    *,
    name: str = "scope",
    cleanup_timeout: float = 10.0,
    deadline: float = math.inf,
) -> AsyncGenerator[OwningScope[T]]:
    """Open an :class:`OwningScope` around a block.

    On leaving the block the scope winds down: work started in it finishes, then the
    resource is released. If the block raises, the scope's work is cancelled instead, and the
    error leaves in an ``ExceptionGroup`` (the block runs inside a task group).
    """
    async with anyio.create_task_group() as host:
        scope: OwningScope[T] = OwningScope(
            acquire, release, name=name, cleanup_timeout=cleanup_timeout, deadline=deadline
        )
        await host.start(scope.run)
        try:
            yield scope
        except BaseException:
            scope.cancel()
            raise
        finally:
            scope.wind_down()
