"""The Mooncake landing pool: runs of consecutive pages, double frees, quarantine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from encdisagg import InternalError, TransferError
from encdisagg.receiver import LandingPool
from encdisagg.transfer import LoopbackEngine, LoopbackFabric

pytestmark = pytest.mark.filterwarnings("error")


def test_runs_are_first_fit_and_consecutive() -> None:
    pool = LandingPool(8, 16)
    assert pool.pages_for(0) == 1
    assert pool.pages_for(17) == 2
    a = pool.alloc(3)
    b = pool.alloc(2)
    assert a is not None
    assert b is not None
    assert (a.start, b.start) == (0, 3)
    pool.free(a)
    # Six pages are free, but in two holes of three: four consecutive ones are not.
    assert pool.available() == 6
    assert pool.alloc(4) is None
    assert pool.available() == 6
    d = pool.alloc(2)
    assert d is not None
    assert d.start == 0
    assert pool.address(d) == pool.ptr
    with pytest.raises(InternalError, match="freed twice"):
        pool.free(a)


def test_quarantined_pages_come_back_after_their_deadline() -> None:
    pool = LandingPool(4, 8)
    run = pool.alloc(4)
    assert run is not None
    pool.quarantine(run, until=10.0)
    assert pool.available() == 0
    assert pool.quarantined_pages == 4
    assert pool.alloc(1, now=9.9) is None
    assert pool.next_reclaim() == 10.0
    again = pool.alloc(4, now=10.0)
    assert again is not None
    assert pool.quarantined_pages == 0


def test_views_cover_the_run() -> None:
    pool = LandingPool(4, 8)
    run = pool.alloc(2)
    assert run is not None
    view = pool.view(run, 12)
    view.fill_(7)
    assert int(pool.buffer[:12].sum()) == 84
    with pytest.raises(InternalError):
        pool.view(run, 17)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_pages_are_never_handed_out_twice(ops: list[tuple[bool, int]]) -> None:
    pool = LandingPool(12, 4)
    live = []
    for take, count in ops:
        if take or not live:
            run = pool.alloc(count)
            if run is not None:
                live.append(run)
        else:
            pool.free(live.pop(0))
        owned = [page for run in live for page in range(run.start, run.start + run.count)]
        assert len(owned) == len(set(owned))
        assert pool.available() == 12 - len(owned)


@pytest.mark.anyio
async def test_registered_for_the_block_only() -> None:
    fabric = LoopbackFabric()
    async with LoopbackEngine(fabric) as receiver, LoopbackEngine(fabric) as writer:
        source = torch.arange(8, dtype=torch.uint8)
        writer.register(source.data_ptr(), 8)
        pool = LandingPool(2, 8)
        async with pool.registered(receiver):
            assert pool.registered_with is receiver
            run = pool.alloc(1)
            assert run is not None
            writer.write(receiver.session_id, source.data_ptr(), pool.address(run), 8)
            assert torch.equal(pool.view(run, 8), source)
        assert receiver.registered_regions() == 0
        with pytest.raises(TransferError):
            writer.write(receiver.session_id, source.data_ptr(), pool.ptr, 8)
