from __future__ import annotations

import gc
import logging

import anyio
import anyio.lowlevel
import pytest

from encdisagg.nurseries import FailurePolicy, ServiceTaskGroup

pytestmark = pytest.mark.anyio


async def test_logged_failure_is_observed_and_siblings_keep_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[tuple[str, BaseException]] = []
    sibling_ran = anyio.Event()

    async def crash() -> None:
        raise RuntimeError("sweeper broke")

    async def sibling() -> None:
        await anyio.lowlevel.checkpoint()
        sibling_ran.set()

    with caplog.at_level(logging.ERROR, logger="encdisagg.services"):
        async with ServiceTaskGroup(
            "test", on_failure=lambda name, exc: seen.append((name, exc))
        ) as services:
            services.start_soon(crash, name="crasher")
            services.start_soon(sibling)
            await sibling_ran.wait()
            await anyio.wait_all_tasks_blocked()
    assert services.failure_count == 1
    assert [name for name, _ in services.failures] == ["crasher"]
    assert seen[0][0] == "crasher"
    assert isinstance(seen[0][1], RuntimeError)
    record = next(r for r in caplog.records if "crasher" in r.getMessage())
    assert record.exc_info is not None
    assert "sweeper broke" in str(record.exc_info[1])


async def test_propagating_failure_leaves_the_group() -> None:
    async def crash() -> None:
        raise LookupError("fatal")

    with pytest.RaisesGroup(LookupError):
        async with ServiceTaskGroup("test", policy=FailurePolicy.PROPAGATE) as services:
            services.start_soon(anyio.sleep_forever)
            services.start_soon(crash)
            await anyio.sleep_forever()


async def test_leaving_the_block_cancels_remaining_tasks() -> None:
    stopped = []

    async def forever() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stopped.append(True)

    async with ServiceTaskGroup("test") as services:
        services.start_soon(forever)
        await anyio.wait_all_tasks_blocked()
    assert stopped == [True]
    with pytest.raises(RuntimeError, match="not open"):
        services.start_soon(forever)


async def test_start_reports_readiness_and_early_failure() -> None:
    async def ready(*, task_status: anyio.abc.TaskStatus[int]) -> None:
        task_status.started(8080)
        await anyio.sleep_forever()

    async def fails_early(*, task_status: anyio.abc.TaskStatus[int]) -> None:
        raise OSError("port in use")

    async def fails_late(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        raise OSError("later")

    async with ServiceTaskGroup("test") as services:
        assert await services.start(ready) == 8080
        with pytest.raises(OSError, match="port in use"):
            await services.start(fails_early)
        await services.start(fails_late)
        await anyio.wait_all_tasks_blocked()
        assert services.failure_count == 1


async def test_starting_and_finishing_tasks_leaves_no_reference_cycles() -> None:
    async def ready(*, task_status: anyio.abc.TaskStatus[int]) -> None:
        task_status.started(1)

    async with ServiceTaskGroup("test") as services:
        # Warm up whatever the backend creates once (caches, the first task's machinery).
        for _ in range(3):
            await services.start(ready)
        await anyio.wait_all_tasks_blocked()
        gc.collect()
        gc.disable()
        try:
            for _ in range(100):
                assert await services.start(ready) == 1
            await anyio.wait_all_tasks_blocked()
            unreachable = gc.collect()
        finally:
            gc.enable()
    assert unreachable == 0
