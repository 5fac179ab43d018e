from __future__ import annotations

import functools
import gc
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import encdisagg.nurseries
from encdisagg.nurseries import collapse_single_error, leaf_exceptions, sole_error

_Task = Callable[[], Coroutine[Any, Any, None]]


class _Interrupt(BaseException):
    """A BaseException that is not a cancellation (pytest treats KeyboardInterrupt apart)."""


def _raise_with_cause() -> None:
    try:
        raise KeyError("the cause")
    except KeyError as exc:
        raise ValueError("the error") from exc


async def _fail_with_cause() -> None:
    await anyio.lowlevel.checkpoint()
    _raise_with_cause()


def test_exported_from_nurseries() -> None:
    for name in ("sole_error", "collapse_single_error", "leaf_exceptions"):
        assert name in encdisagg.nurseries.__all__
        assert getattr(encdisagg.nurseries, name).__module__ == "encdisagg.nurseries"


def test_leaves_are_flattened_in_order() -> None:
    a, b, c = ValueError("a"), KeyError("b"), OSError("c")
    group = ExceptionGroup("outer", [a, ExceptionGroup("inner", [b, ExceptionGroup("x", [c])])])
    assert leaf_exceptions(group) == [a, b, c]
    assert leaf_exceptions(a) == [a]


def test_sole_error_of_plain_and_nested_groups() -> None:
    leaf = ValueError("only")
    assert sole_error(leaf) is leaf
    assert sole_error(ExceptionGroup("g", [leaf])) is leaf
    assert sole_error(
        ExceptionGroup("g", [ExceptionGroup("h", [ExceptionGroup("i", [leaf])])])
    ) is (leaf)
    two = ExceptionGroup("g", [leaf, ExceptionGroup("h", [KeyError("k")])])
    assert sole_error(two) is two
    interrupted = BaseExceptionGroup("g", [_Interrupt()])
    assert sole_error(interrupted) is interrupted


async def _collapsed(*tasks: _Task) -> None:
    """Run ``tasks`` in a task group, under :func:`collapse_single_error`."""
    with collapse_single_error():
        async with anyio.create_task_group() as group:
            for task in tasks:
                group.start_soon(task)


async def _unwrapped_by_hand(task: _Task) -> None:
    """Run ``task`` in a task group; raise :func:`sole_error` of what it raised, outside
    the handler."""
    failure: BaseException | None = None
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(task)
    except BaseExceptionGroup as exc:
        failure = sole_error(exc)
        if failure is exc:
            raise
    if failure is not None:
        raise failure


@pytest.mark.anyio
@pytest.mark.parametrize("unwrap", [_collapsed, _unwrapped_by_hand])
async def test_one_failing_task_leaves_as_itself_with_its_cause(
    unwrap: Callable[[_Task], Awaitable[None]],
) -> None:
    with pytest.raises(ValueError, match="the error") as caught:
        await unwrap(_fail_with_cause)
    error = caught.value
    assert isinstance(error.__cause__, KeyError)
    assert error.__cause__.args == ("the cause",)
    # The group it came out of is not attached as its context.
    assert not isinstance(error.__context__, BaseExceptionGroup)
    # Its own traceback still reaches the line that raised it.
    frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    assert "_raise_with_cause" in frames


@pytest.mark.anyio
async def test_nested_task_groups_collapse_to_the_one_error() -> None:
    async def inner() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(_fail_with_cause)

    with pytest.raises(ValueError, match="the error") as caught:
        await _collapsed(inner)
    assert isinstance(caught.value.__cause__, KeyError)


@pytest.mark.anyio
async def test_the_context_a_leaf_was_raised_with_is_kept() -> None:
    async def fail_while_handling() -> None:
        await anyio.lowlevel.checkpoint()
        try:
            raise OSError("being handled")
        except OSError:
            raise ValueError("raised during handling")  # noqa: B904

    with pytest.raises(ValueError, match="during handling") as caught:
        await _collapsed(fail_while_handling)
    assert caught.value.__cause__ is None
    assert isinstance(caught.value.__context__, OSError)


@pytest.mark.anyio
async def test_an_error_that_crossed_a_group_with_a_running_child_keeps_no_group_context() -> None:
    # A context manager whose task group runs a child while the block raises, entered through
    # an exit stack with a task group inside: on asyncio the error came out with the group it
    # had been wrapped in as its context. Collapsing drops that context, keeps the cause.
    from contextlib import AsyncExitStack, asynccontextmanager

    @asynccontextmanager
    async def with_a_child() -> Any:
        with collapse_single_error():
            async with anyio.create_task_group() as group:
                group.start_soon(anyio.sleep_forever)
                try:
                    yield
                finally:
                    group.cancel_scope.cancel()

    async def run() -> None:
        with collapse_single_error():
            async with AsyncExitStack() as stack:
                await stack.enter_async_context(with_a_child())
                async with anyio.create_task_group():
                    _raise_with_cause()

    with pytest.raises(ValueError, match="the error") as caught:
        await run()
    assert isinstance(caught.value.__cause__, KeyError)
    assert not isinstance(caught.value.__context__, BaseExceptionGroup)


@pytest.mark.anyio
async def test_a_group_of_two_errors_stays_a_group() -> None:
    gate = anyio.Event()

    async def fail(error: Exception) -> None:
        # Shielded, so the first failure's cancellation cannot stop the second one.
        with anyio.CancelScope(shield=True):
            await gate.wait()
        raise error

    async def open_gate() -> None:
        await anyio.wait_all_tasks_blocked()
        gate.set()

    with pytest.RaisesGroup(ValueError, KeyError):
        await _collapsed(
            functools.partial(fail, ValueError("one")),
            functools.partial(fail, KeyError("two")),
            open_gate,
        )


def _reraise_collapsed(exc: BaseException) -> None:
    with collapse_single_error():
        raise exc


@pytest.mark.anyio
async def test_a_cancellation_is_never_unwrapped() -> None:
    cancelled = anyio.get_cancelled_exc_class()
    captured: list[BaseException] = []
    kept: list[BaseException] = []
    with anyio.CancelScope() as outer:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(anyio.sleep_forever)
                await anyio.wait_all_tasks_blocked()
                outer.cancel()
                await anyio.sleep_forever()
        except BaseException as exc:  # the cancellation, as the task group raised it
            captured.append(exc)
            raise
    [raised] = captured
    # As a group of one (what a Trio nursery raises), it stays a group.
    lone = (
        raised if isinstance(raised, BaseExceptionGroup) else BaseExceptionGroup("lone", [raised])
    )
    assert all(isinstance(leaf, cancelled) for leaf in leaf_exceptions(lone))
    assert sole_error(lone) is lone
    try:
        _reraise_collapsed(lone)
    except BaseException as raised:
        kept.append(raised)
    assert kept == [lone]
    assert outer.cancelled_caught


def test_a_lone_base_exception_stays_in_its_group() -> None:
    group = BaseExceptionGroup("g", [_Interrupt("stop")])
    with pytest.raises(BaseExceptionGroup) as caught:
        _reraise_collapsed(group)
    assert caught.value is group


def test_other_exceptions_and_no_exception_pass_unchanged() -> None:
    with collapse_single_error():
        pass
    error = ValueError("plain")
    with pytest.raises(ValueError) as caught:
        _reraise_collapsed(error)
    assert caught.value is error


def test_collapsing_leaves_no_reference_cycle() -> None:
    def collapse_once() -> None:
        try:
            with collapse_single_error():
                raise ExceptionGroup("g", [ValueError("only")])
        except ValueError:
            pass

    gc.collect()
    gc.disable()
    try:
        for _ in range(10):
            collapse_once()
        assert gc.collect() == 0
    finally:
        gc.enable()
