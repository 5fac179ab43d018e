from __future__ import annotations

import threading

import anyio
import anyio.from_thread
import pytest

from encdisagg.nurseries import run_thread_to_completion

pytestmark = pytest.mark.anyio


async def test_returns_the_result_and_propagates_errors() -> None:
    assert await run_thread_to_completion(sum, [1, 2, 3]) == 6

    def fail() -> None:
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        await run_thread_to_completion(fail)


async def test_cancelled_twice_returns_only_after_the_thread_finished() -> None:
    record: list[str] = []
    thread_started = anyio.Event()
    let_thread_finish = threading.Event()

    def blocking_work() -> str:
        anyio.from_thread.run_sync(thread_started.set)
        let_thread_finish.wait()
        record.append("thread finished")
        return "done"

    async def caller(scope: anyio.CancelScope) -> None:
        with scope:
            await run_thread_to_completion(blocking_work)
            record.append("unreachable: cancellation must be raised")
        record.append("caller returned")

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(caller, scope)
        await thread_started.wait()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        # Two cancellations delivered, and still the caller waits for the thread.
        assert record == []
        let_thread_finish.set()
    assert record == ["thread finished", "caller returned"]
    assert scope.cancelled_caught


async def test_cancellation_during_the_call_is_raised_right_after_it() -> None:
    after_call: list[object] = []
    scope = anyio.CancelScope()

    def cancel_from_inside() -> int:
        anyio.from_thread.run_sync(scope.cancel)
        return 42

    with scope:
        after_call.append(await run_thread_to_completion(cancel_from_inside))
    assert scope.cancelled_caught
    assert after_call == []


async def test_limiter_bounds_concurrent_calls() -> None:
    limiter = anyio.CapacityLimiter(1)
    running = 0
    most = 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        with lock:
            running -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(lambda: run_thread_to_completion(work, limiter=limiter))
    assert most == 1
