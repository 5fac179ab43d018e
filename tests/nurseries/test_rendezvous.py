from __future__ import annotations

import anyio
import pytest

from encdisagg.nurseries import KeyedRendezvous, KeyRemovedError

pytestmark = pytest.mark.anyio


async def test_publish_wakes_every_waiter() -> None:
    table: KeyedRendezvous[str, int] = KeyedRendezvous()
    seen: list[int] = []

    async def waiter() -> None:
        seen.append(await table.wait("req-1"))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert table.waiting("req-1") == 3
        assert "req-1" not in table
        table.publish("req-1", 7)
    assert seen == [7, 7, 7]
    assert table.waiting("req-1") == 0


async def test_published_key_returns_at_once_and_still_checkpoints() -> None:
    table: KeyedRendezvous[str, str] = KeyedRendezvous()
    table.publish("a", "value")
    with anyio.CancelScope() as scope:
        scope.cancel()
        await table.wait("a")
    assert scope.cancelled_caught


@pytest.mark.virtual_time
async def test_timeout_leaves_no_state() -> None:
    table: KeyedRendezvous[str, int] = KeyedRendezvous()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(180):
            await table.wait("never")
    assert table.waiting("never") == 0
    assert len(table) == 0
    assert table._wakeups == {}


async def test_cancellation_leaves_no_state() -> None:
    table: KeyedRendezvous[str, int] = KeyedRendezvous()
    async with anyio.create_task_group() as tg:
        tg.start_soon(table.wait, "gone")
        tg.start_soon(table.wait, "gone")
        await anyio.wait_all_tasks_blocked()
        assert table.waiting("gone") == 2
        tg.cancel_scope.cancel()
    assert table.waiting("gone") == 0
    assert table._wakeups == {}


async def test_remove_wakes_waiters_with_an_error() -> None:
    table: KeyedRendezvous[str, int] = KeyedRendezvous()
    outcomes: list[str] = []

    async def waiter() -> None:
        try:
            await table.wait("k")
        except KeyRemovedError:
            outcomes.append("removed")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert table.remove("k") is None
    assert outcomes == ["removed", "removed"]
    assert table._wakeups == {}


async def test_a_waiter_after_a_removal_waits_afresh() -> None:
    table: KeyedRendezvous[str, int] = KeyedRendezvous()
    table.publish("k", 1)
    assert table.remove("k") == 1
    got: list[int] = []

    async def waiter() -> None:
        got.append(await table.wait("k"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        table.publish("k", 2)
    assert got == [2]
