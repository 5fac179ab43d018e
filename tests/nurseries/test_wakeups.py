from __future__ import annotations

import anyio
import pytest

from encdisagg.nurseries import KeyedWakeups

pytestmark = pytest.mark.anyio


async def test_wake_reaches_every_parked_task_and_leaves_nothing() -> None:
    wakeups: KeyedWakeups[str] = KeyedWakeups()
    flags: list[bool] = []

    async def parked() -> None:
        flags.append(await wakeups.park("k"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(parked)
        tg.start_soon(parked)
        await anyio.wait_all_tasks_blocked()
        assert wakeups.waiting("k") == 2
        wakeups.wake("other")
        await anyio.wait_all_tasks_blocked()
        assert flags == []
        wakeups.wake("k", removed=True)
    assert flags == [True, True]
    assert wakeups.waiting("k") == 0
    assert wakeups._wakeups == {}


async def test_cancelled_park_leaves_nothing() -> None:
    wakeups: KeyedWakeups[int] = KeyedWakeups()
    with anyio.move_on_after(0.01):
        await wakeups.park(1)
    assert wakeups.waiting(1) == 0
    assert wakeups._wakeups == {}
