"""The deadline keeper in virtual time: records expire in order, once, unless they retired."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest

from encdisagg import EncodeRequest
from encdisagg.encoder._deadlines import DeadlineKeeper
from encdisagg.encoder._table import RequestRecord

pytestmark = [pytest.mark.anyio, pytest.mark.virtual_time]


def record(req_id: str, deadline: float) -> RequestRecord:
    return RequestRecord(EncodeRequest(req_id, [1]), deadline=deadline)


class Expiries:
    """The keeper's ``expire``: notes which record expired when, and wakes a waiter once
    ``expected`` of them did."""

    def __init__(self) -> None:
        self.log: list[tuple[str, float]] = []
        self.expected = 0
        self.enough = anyio.Event()

    def __call__(self, expired: RequestRecord) -> None:
        self.log.append((expired.req_id, anyio.current_time()))
        if len(self.log) >= self.expected:
            self.enough.set()

    async def wait_for(self, count: int) -> None:
        self.expected = count
        if len(self.log) < count:
            await self.enough.wait()
        self.enough = anyio.Event()

    @property
    def ids(self) -> list[str]:
        return [req_id for req_id, _ in self.log]


async def test_records_expire_in_order_at_their_deadlines() -> None:
    expiries = Expiries()
    keeper = DeadlineKeeper(expiries, lambda: 3)
    start = anyio.current_time()
    records = [record(f"r{i}", start + 10.0 * (i + 1)) for i in range(3)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        for each in records:
            keeper.add(each)
        await expiries.wait_for(3)
        tg.cancel_scope.cancel()
    assert expiries.ids == ["r0", "r1", "r2"]
    for (_, at), each, later in zip(expiries.log, records, [*records[1:], None], strict=True):
        # Not early, and not held up past the next one's deadline.
        assert at >= each.deadline
        if later is not None:
            assert at < later.deadline
    assert len(keeper) == 0


async def test_a_record_retired_before_its_deadline_is_skipped() -> None:
    expiries = Expiries()
    keeper = DeadlineKeeper(expiries, lambda: 3)
    start = anyio.current_time()
    first, second, third = (record(f"r{i}", start + 10.0 * (i + 1)) for i in range(3))
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        for each in (first, second, third):
            keeper.add(each)
        # The keeper sleeps until the head's deadline; the head retires meanwhile.
        await anyio.wait_all_tasks_blocked()
        first.retired = True
        await anyio.sleep_until(first.deadline + 1)
        assert expiries.ids == []
        second.retired = True
        await expiries.wait_for(1)
        tg.cancel_scope.cancel()
    assert expiries.ids == ["r2"]


async def test_expire_is_called_once_per_record_even_if_it_stays_live() -> None:
    expiries = Expiries()
    keeper = DeadlineKeeper(expiries, lambda: 5)
    start = anyio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        for i in range(5):
            # Deadlines may tie; several may be due at once.
            keeper.add(record(f"r{i}", start + 5.0 * (i // 2)))
        await expiries.wait_for(5)
        # Nothing retires the records: the keeper must not come back to them.
        await anyio.sleep(100)
        tg.cancel_scope.cancel()
    assert Counter(expiries.ids) == Counter(f"r{i}" for i in range(5))
    assert expiries.ids == [f"r{i}" for i in range(5)]


async def test_the_keeper_waits_for_records_added_later() -> None:
    expiries = Expiries()
    keeper = DeadlineKeeper(expiries, lambda: 1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        await anyio.sleep(50)
        assert expiries.ids == []
        late = record("late", anyio.current_time() + 1.0)
        keeper.add(late)
        past = record("past", anyio.current_time())
        keeper.add(past)
        await expiries.wait_for(2)
        tg.cancel_scope.cancel()
    assert expiries.ids == ["late", "past"]
    assert expiries.log[0][1] >= late.deadline


async def test_the_fifo_compacts_when_most_records_retire_early() -> None:
    expiries = Expiries()
    live: set[str] = set()
    keeper = DeadlineKeeper(expiries, lambda: len(live))
    start = anyio.current_time()
    kept: list[RequestRecord] = []
    longest = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        for i in range(2000):
            each = record(f"r{i}", start + 100.0 + i * 0.001)
            live.add(each.req_id)
            keeper.add(each)
            if i % 100 == 0:
                # One in a hundred stays until its deadline.
                kept.append(each)
            else:
                each.retired = True
                live.discard(each.req_id)
            longest = max(longest, len(keeper))
        assert len(live) == len(kept) == 20
        # Retired records are dropped once they outnumber the live ones (plus a margin):
        # the FIFO never holds much more than twice what is live, not all 2000.
        assert longest <= 2 * (len(kept) + 1) + 64 + 1
        await expiries.wait_for(len(kept))
        tg.cancel_scope.cancel()
    assert expiries.ids == [each.req_id for each in kept]
    assert len(keeper) == 0
