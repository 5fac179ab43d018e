"""The Mooncake landing pool: runs of consecutive pages, double frees, quarantine."""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import given, strategies as st

from encdisagg import BadRequestError, InternalError, ServiceUnavailableError, TransferError
from encdisagg.receiver import (
    EmbeddingReceiver,
    EncoderClient,
    LandingPool,
    MooncakeSendTarget,
    PartMetadata,
)
from encdisagg.transfer import Hold, LoopbackEngine, LoopbackFabric


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


def test_held_runs_stay_out_of_use_until_settled_or_reused() -> None:
    pool = LandingPool(4, 8)
    a = pool.alloc(2)
    b = pool.alloc(2)
    assert a is not None
    assert b is not None
    held = Hold("landing pages 0+2", 16)
    pool.hold(a, held)
    pool.free(b)
    # a write may still land in a: only b's pages come back.
    assert (pool.available(), pool.alloc(3)) == (2, None)
    assert pool.held_runs() == (a,)
    assert (pool.quarantined_pages, pool.retired_pages, pool.held_bytes) == (2, 0, 16)
    with pytest.raises(InternalError, match="not live"):
        pool.hold(a, Hold("again"))
    # Past the bound, retired: still out of use.
    pool.retire(a)
    assert (pool.quarantined_pages, pool.retired_pages, pool.held_pages) == (0, 2, 2)
    assert pool.available() == 2
    # Proof that the write ended gives them back.
    pool.settle(a, "the encoder confirmed")
    assert held.settled
    assert (pool.held_pages, pool.held_bytes, pool.available()) == (0, 0, 4)
    # Reused past the bound: back in use, but the hold stays: a write may still land.
    c = pool.alloc(2)
    assert c == a
    reused = Hold("landing pages 0+2", 16)
    pool.hold(c, reused)
    pool.reuse(c)
    assert not reused.settled
    assert (pool.held_pages, pool.held_bytes, pool.available()) == (0, 16, 4)


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


def _metadata(req_id: str) -> PartMetadata:
    # 2 tokens x 64 float32 = 512 bytes: two 256-byte landing pages.
    return PartMetadata(
        req_id=req_id,
        part_idx=0,
        embedding_size=512,
        embedding_len=2,
        embedding_dim=64,
        token_counts=(2,),
        grid=((1, 2, 4),),
    )


@pytest.mark.anyio
@pytest.mark.virtual_time
async def test_parts_wait_for_landing_pages_and_quarantine_holds_unconfirmed_ones() -> None:
    client = EncoderClient(["http://e0"])
    async with (
        LoopbackEngine() as engine,
        EmbeddingReceiver(
            transport="mooncake",
            hidden_size=64,
            dtype=torch.float32,
            engine=engine,
            landing_pages=2,
            page_bytes=256,
            alloc_timeout_s=10.0,
            quarantine_s=60.0,
            on_quarantine_timeout="reuse",
        ) as receiver,
    ):
        got: list[float] = []

        async def second() -> None:
            async with receiver.expect(client.plan("b", {"image": ["x"]})) as pending:
                pending.note_metadata(_metadata("b#0"))
                target = await pending.target(0)
                got.append(anyio.current_time())
                assert isinstance(target, MooncakeSendTarget)
                assert target.buffer_address == receiver.pool.ptr
                pending.note_sent(0)

        async with anyio.create_task_group() as group:
            async with receiver.expect(client.plan("a", {"image": ["x"]})) as pending:
                pending.note_metadata(_metadata("a#0"))
                await pending.target(0)
                group.start_soon(second)
                await anyio.sleep(5.0)
                assert got == []  # b waits: a holds every page
                pending.note_sent(0)  # a's write is over: its pages may be reused
            start = anyio.current_time()
        assert got == [pytest.approx(start, abs=0.1)]

        # A target whose write was never confirmed over is quarantined when its request ends.
        async with receiver.expect(client.plan("c", {"image": ["x"]})) as pending:
            pending.note_metadata(_metadata("c#0"))
            await pending.target(0)
        assert receiver.stats().quarantined_pages == 2
        async with receiver.expect(client.plan("d", {"image": ["x"]})) as pending:
            pending.note_metadata(_metadata("d#0"))
            with pytest.raises(ServiceUnavailableError, match=r"within 10\.0 s"):
                await pending.target(0)
        # Once the quarantine is over, the pages come back (the policy says to reuse them).
        await anyio.sleep(60.0)
        async with receiver.expect(client.plan("e", {"image": ["x"]})) as pending:
            pending.note_metadata(_metadata("e#0"))
            await pending.target(0)
            pending.note_sent(0)
        stats = receiver.stats()
        assert (stats.quarantined_pages, stats.landing_pages_in_use, stats.live_requests) == (
            0,
            0,
            0,
        )


@pytest.mark.anyio
async def test_a_confirmed_release_frees_a_targeted_run() -> None:
    client = EncoderClient(["http://e0"])
    async with (
        LoopbackEngine() as engine,
        EmbeddingReceiver(
            transport="mooncake",
            hidden_size=64,
            dtype=torch.float32,
            engine=engine,
            landing_pages=2,
            page_bytes=256,
        ) as receiver,
    ):
        async with receiver.expect(client.plan("a", {"image": ["x"]})) as pending:
            pending.note_metadata(_metadata("a#0"))
            await pending.target(0)
            pending.confirm_stopped({"a#0"})
        assert receiver.stats().quarantined_pages == 0
        assert receiver.pool.available() == 2
        with pytest.raises(BadRequestError, match="embedding_size is 100 bytes"):
            async with receiver.expect(client.plan("b", {"image": ["x"]})) as pending:
                pending.note_metadata(
                    PartMetadata(
                        req_id="b#0",
                        part_idx=0,
                        embedding_size=100,
                        embedding_len=2,
                        embedding_dim=64,
                        token_counts=(2,),
                        grid=((1, 2, 4),),
                    )
                )
