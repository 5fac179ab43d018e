from __future__ import annotations

import anyio
import pytest

from encdisagg.nurseries import loop_checkpoint, loop_clock

pytestmark = pytest.mark.anyio


async def test_loop_clock_reads_what_anyio_reads() -> None:
    clock = loop_clock()
    before = anyio.current_time()
    now = clock()
    assert before <= now <= anyio.current_time()


async def test_loop_checkpoint_lets_another_task_run() -> None:
    checkpoint = loop_checkpoint()
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    async with anyio.create_task_group() as group:
        group.start_soon(other)
        assert ran == []
        # Trio may order the two tasks either way within one batch: a few rounds at most.
        for _ in range(10):
            await checkpoint()
            if ran:
                break
        assert ran == ["other"]


async def test_loop_checkpoint_is_a_cancel_point() -> None:
    checkpoint = loop_checkpoint()
    reached = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await checkpoint()
        reached = True
    assert scope.cancelled_caught
    assert not reached


async def test_loop_checkpoint_inside_a_shield_only_schedules() -> None:
    checkpoint = loop_checkpoint()
    with anyio.CancelScope() as outer:
        outer.cancel()
        with anyio.CancelScope(shield=True):
            await checkpoint()
            passed = True
    assert passed
