"""KVPagePool, MetadataSlotTable and PagedKVSink; registration on both backends."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

from encdisagg import InternalError, TransferError
from encdisagg.decode import (
    AbortAckTracker,
    CommitStatus,
    DecodePreallocQueue,
    DecodeRequest,
    DecodeTransferQueue,
    KVPagePool,
    KVPoll,
    MetadataSlotAllocator,
    MetadataSlotTable,
    PagedKVSink,
    PreallocRequest,
    kv_checksum,
)
from encdisagg.transfer import Hold, LoopbackEngine, MemoryRegistrationState

from ._fakes import CopyingEngine, FakeClock

#: Both registered buffers of the decode side, made small.
MEMORIES: dict[str, Callable[[], KVPagePool | MetadataSlotTable]] = {
    "pages": lambda: KVPagePool(2, 16),
    "rows": lambda: MetadataSlotTable(2),
}


class TestKVPagePool:
    def test_pages_are_slices_of_one_flat_buffer(self) -> None:
        pool = KVPagePool(4, 64, dtype=torch.float16)
        assert pool.buffer.dtype == torch.float16
        assert pool.buffer.numel() == 4 * 32
        assert pool.nbytes == 256
        assert pool.page_address(0) == pool.ptr
        assert pool.page_address(3) == pool.ptr + 3 * 64
        pool.page(2).fill_(1.5)
        assert pool.buffer[64:96].eq(1.5).all()
        assert pool.buffer[:64].eq(0).all()
        with pytest.raises(InternalError, match="out of range"):
            pool.page_address(4)

    def test_alloc_free_and_double_free(self) -> None:
        pool = KVPagePool(3, 16)
        pages = pool.alloc(2)
        assert pages == (0, 1)
        assert pool.available() == 1
        assert pool.alloc(2) is None
        pool.free(pages)
        with pytest.raises(InternalError, match="freed twice"):
            pool.free(pages)
        assert pool.available() == 3

    def test_page_bytes_must_fit_the_dtype(self) -> None:
        with pytest.raises(ValueError, match="page_bytes"):
            KVPagePool(2, 6, dtype=torch.float32)
        with pytest.raises(ValueError, match="page_bytes"):
            KVPagePool(2, 0)


class TestMetadataSlotTable:
    def test_write_read_zero(self) -> None:
        table = MetadataSlotTable(4)
        assert table.row_bytes == 64
        assert table.row_address(1) == table.ptr + 64
        assert table.is_zero(1)
        table.write(1, room=77, first_token_id=5, cached_tokens=12, checksum=9)
        row = table.read(1)
        assert (row.room, row.first_token_id, row.cached_tokens, row.checksum) == (77, 5, 12, 9)
        assert table.is_zero(0)
        assert table.is_zero(2)
        table.zero(1)
        assert table.is_zero(1)
        assert table.read(1).room == 0
        with pytest.raises(InternalError, match="out of range"):
            table.read(4)


def sink_setup(
    pages: int = 8, slots: int = 4
) -> tuple[KVPagePool, MetadataSlotTable, MetadataSlotAllocator, PagedKVSink]:
    pool = KVPagePool(pages, 32)
    table = MetadataSlotTable(slots)
    allocator = MetadataSlotAllocator(slots, zero_slot=table.zero)
    return pool, table, allocator, PagedKVSink(pool, table)


def make_req(
    rid: str, room: int, pool: KVPagePool, slots: MetadataSlotAllocator, n: int = 2
) -> DecodeRequest:
    pages = pool.alloc(n)
    assert pages is not None
    return DecodeRequest(rid, room, slots.alloc(), 1, pages=pages)


class TestPagedKVSink:
    def test_commit_follows_the_room_tag_and_checksum(self) -> None:
        pool, table, slots, sink = sink_setup()
        req = make_req("r", 11, pool, slots)
        assert req.metadata_slot is not None
        assert sink.commit(req) is CommitStatus.NOT_READY
        for page in req.pages:
            pool.page(page).fill_(page + 1)
        good = pool.checksum(req.pages)
        assert good != 0
        table.write(req.metadata_slot, room=12, first_token_id=3)
        assert sink.commit(req) is CommitStatus.CORRUPT
        table.write(req.metadata_slot, room=11, first_token_id=3, checksum=good + 1)
        assert sink.commit(req) is CommitStatus.CORRUPT
        table.write(req.metadata_slot, room=11, first_token_id=3, checksum=good)
        assert sink.commit(req) is CommitStatus.COMMITTED
        assert req.metadata is not None
        assert req.metadata.first_token_id == 3

    def test_release_frees_the_pages_once(self) -> None:
        pool, _table, slots, sink = sink_setup()
        req = make_req("r", 11, pool, slots, n=3)
        sink.release(req)
        assert pool.available() == 8
        assert req.pages == ()
        sink.release(req)  # the request no longer owns pages: nothing to free twice
        assert pool.available() == 8

    def test_abort_reaches_the_callback(self) -> None:
        pool, table, _slots, _sink = sink_setup()
        seen: list[tuple[str, str]] = []
        sink = PagedKVSink(pool, table, on_abort=lambda req, msg: seen.append((req.rid, msg)))
        sink.abort(DecodeRequest("x", 1, 0, 1), "gone")
        assert seen == [("x", "gone")]

    def test_queue_over_the_real_table_zeroes_rows_before_slots_return(self) -> None:
        pool, table, slots, sink = sink_setup()
        queue = DecodeTransferQueue(kv=sink, slots=slots, acks=AbortAckTracker(), clock=FakeClock())
        ok = make_req("ok", 21, pool, slots)
        late = make_req("late", 22, pool, slots)
        collided = make_req("collided", 23, pool, slots)
        for req in (ok, late, collided):
            queue.add(req)
        assert ok.metadata_slot is not None
        assert collided.metadata_slot is not None
        ok_slot, collided_slot = ok.metadata_slot, collided.metadata_slot
        table.write(ok_slot, room=21, first_token_id=100, checksum=pool.checksum(ok.pages))
        table.write(collided_slot, room=99, first_token_id=1)

        out = queue.pop_transferred(dict.fromkeys(["ok", "late", "collided"], KVPoll.Success))

        assert out == [ok]
        assert queue.queue == [late]
        assert table.is_zero(ok_slot)
        assert table.is_zero(collided_slot)
        assert not slots.is_allocated(ok_slot)
        assert not slots.is_allocated(collided_slot)
        # ok keeps its pages for decoding; the collided request's pages are free again.
        assert pool.is_allocated(ok.pages[0])
        assert pool.available() == 8 - 4

    def test_checksum_of_chunks(self) -> None:
        data = torch.arange(8, dtype=torch.int32)
        assert kv_checksum([data]) == kv_checksum([data[:4], data[4:]])
        assert kv_checksum([]) == 1


@pytest.mark.anyio
async def test_registered_once_from_a_worker_thread_and_deregistered_on_exit() -> None:
    engine = CopyingEngine()
    pool = KVPagePool(4, 32)
    table = MetadataSlotTable(2)
    async with pool.registered(engine) as same, table.registered(engine):
        assert same is pool
        assert pool.registered_with is engine
        assert engine.regions == {pool.ptr: pool.nbytes, table.ptr: table.nbytes}
        with pytest.raises(InternalError, match="registered already"):
            async with pool.registered(engine):
                pass
    assert engine.regions == {}
    assert pool.registered_with is None
    assert engine.calls == [
        ("register", pool.ptr),
        ("register", table.ptr),
        ("deregister", table.ptr),
        ("deregister", pool.ptr),
    ]
    assert threading.main_thread().name not in engine.threads


@pytest.mark.anyio
async def test_a_remote_writer_lands_in_the_pages_while_registered() -> None:
    engine = CopyingEngine()
    pool = KVPagePool(4, 32)
    source = torch.arange(32, dtype=torch.uint8)
    async with pool.registered(engine):
        engine.write("peer", int(source.data_ptr()), pool.page_address(2), 32)
        assert torch.equal(pool.page(2), source)
    with pytest.raises(TransferError, match="unregistered"):
        engine.write("peer", int(source.data_ptr()), pool.page_address(1), 32)


@pytest.mark.anyio
async def test_cancelled_while_registered_still_deregisters() -> None:
    engine = CopyingEngine()
    pool = KVPagePool(2, 16)
    with anyio.CancelScope() as scope:
        async with pool.registered(engine):
            scope.cancel()
            await anyio.sleep_forever()
    assert engine.regions == {}
    assert [call for call, _ in engine.calls] == ["register", "deregister"]


@pytest.mark.anyio
async def test_failed_registration_leaves_nothing_registered() -> None:
    engine = CopyingEngine()
    engine.fail_register = True
    pool = KVPagePool(2, 16)
    with pytest.raises(TransferError, match="register"):
        async with pool.registered(engine):
            pytest.fail("entered an unregistered pool")
    assert pool.registered_with is None
    assert engine.calls == []


@pytest.mark.anyio
async def test_failed_deregistration_is_raised_or_noted() -> None:
    engine = CopyingEngine()
    engine.fail_deregister = True
    pool = KVPagePool(2, 16)
    # Retried until the bound runs out, then left to the engine: never freed under it.
    with pytest.raises(TransferError, match="deregister"):
        async with pool.registered(engine, close_timeout_s=0.2):
            pass
    with pytest.raises(KeyError, match="original") as caught:
        async with pool.registered(engine, close_timeout_s=0.2):
            raise KeyError("original")
    assert any("deregistering" in note for note in caught.value.__notes__)


class GatedRegisterEngine(CopyingEngine):
    """Registration blocks (in its worker thread) until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def register(self, ptr: int, nbytes: int) -> None:
        self.entered.set()
        assert self.gate.wait(timeout=10), "the test never opened the gate"
        super().register(ptr, nbytes)


@pytest.mark.anyio
@pytest.mark.parametrize("memory", MEMORIES)
async def test_a_registration_cancelled_inside_the_engine_is_recorded_and_undone(
    memory: str,
) -> None:
    engine = GatedRegisterEngine()
    owner = MEMORIES[memory]()
    entered_block = False

    async def register() -> None:
        nonlocal entered_block
        async with owner.registered(engine):
            entered_block = True

    async with anyio.create_task_group() as group:
        group.start_soon(register)
        assert await anyio.to_thread.run_sync(engine.entered.wait, 10.0)
        group.cancel_scope.cancel()
        # The engine registers after the caller was cancelled: that registration is not lost.
        engine.gate.set()
    assert not entered_block
    assert engine.regions == {}
    assert [call for call, _ in engine.calls] == ["register", "deregister"]
    assert owner.registered_with is None
    assert owner.registration is None


@pytest.mark.anyio
@pytest.mark.virtual_time
@pytest.mark.parametrize("memory", MEMORIES)
async def test_a_held_buffer_is_left_to_the_engine_at_close_and_kept_alive(memory: str) -> None:
    engine = LoopbackEngine(name="decode")
    owner = MEMORIES[memory]()
    buffer = weakref.ref(owner.buffer if isinstance(owner, KVPagePool) else owner.rows)
    hold = Hold("what a late prefill write may still reach")
    async with owner.registered(engine) as same:
        assert same is owner
        registration = owner.registration
        assert registration is not None
        owner.hold(hold)
        assert registration.held
    # The default bound ran out with the hold unsettled: neither deregistered nor freed.
    assert registration.state is MemoryRegistrationState.LEFT
    assert engine.registered_regions() == 1
    assert owner.registered_with is None
    # Only the engine keeps it now (the loop lets go of the cancelled wait at a checkpoint).
    del owner, same, registration, hold
    await anyio.lowlevel.checkpoint()
    gc.collect()
    assert buffer() is not None
    # Nothing touches memory through a closed engine: it goes.
    engine.close()
    gc.collect()
    assert buffer() is None


@pytest.mark.anyio
@pytest.mark.parametrize("memory", MEMORIES)
async def test_a_held_buffer_is_not_waited_for(memory: str) -> None:
    engine = LoopbackEngine(name="decode")
    owner = MEMORIES[memory]()
    # Whoever could settle the hold is gone with the block: leaving it must not wait.
    with anyio.fail_after(5):
        async with owner.registered(engine, close_timeout_s=3600):
            owner.hold(Hold("retired pages"))
            registration = owner.registration
    assert registration is not None
    assert registration.state is MemoryRegistrationState.LEFT
    assert engine.registered_regions() == 1
    engine.close()


@pytest.mark.anyio
async def test_a_hold_settled_before_the_block_ends_lets_the_deregistration_through() -> None:
    engine = LoopbackEngine(name="decode")
    pool = KVPagePool(2, 16)
    hold = Hold("pages of an aborted request")
    async with pool.registered(engine):
        pool.hold(hold)
        # The proof arrives from another thread (an engine's, a message handler's).
        await anyio.to_thread.run_sync(hold.settle, "every rank acked")
        registration = pool.registration
        assert registration is not None
        assert not registration.held
    assert registration.state is MemoryRegistrationState.DEREGISTERED
    assert engine.registered_regions() == 0
    engine.close()


@pytest.mark.anyio
async def test_the_sink_holds_both_the_pages_and_the_rows() -> None:
    engine = LoopbackEngine(name="decode")
    pool, table, slots, sink = sink_setup()
    req = make_req("r", 11, pool, slots)
    hold = Hold("pages and row of 'r'")
    async with pool.registered(engine), table.registered(engine):
        sink.hold(req, hold)
        assert pool.registration is not None
        assert table.registration is not None
        assert pool.registration.held
        assert table.registration.held
        hold.settle("every rank acked")
        assert not pool.registration.held
        assert not table.registration.held
    assert engine.registered_regions() == 0
    engine.close()


@pytest.mark.anyio
async def test_the_deregistration_bound_must_not_be_negative() -> None:
    engine = CopyingEngine()
    with pytest.raises(ValueError, match="close_timeout_s"):
        async with KVPagePool(2, 16).registered(engine, close_timeout_s=-1):
            pass
    assert engine.calls == []


def test_held_pages_are_not_reused_until_the_prefill_drained() -> None:
    """Rule 15 end to end: a write that lands after the abort hits only the aborted pages."""
    pool = KVPagePool(4, 16)
    table = MetadataSlotTable(4)
    slots = MetadataSlotAllocator(4, zero_slot=table.zero)
    acks = AbortAckTracker()
    clock = FakeClock()
    sink = PagedKVSink(pool, table)
    transfer = DecodeTransferQueue(kv=sink, slots=slots, acks=acks, clock=clock)
    prealloc = DecodePreallocQueue(pages=pool, slots=slots)

    prealloc.add(PreallocRequest("a", 1, num_pages=4, required_acks=2))
    (a,) = prealloc.pop_preallocated({"a": KVPoll.WaitingForInput}).preallocated
    transfer.add(a)
    # The client goes away mid-transfer: arm, tell both prefill ranks, see it fail.
    a.generation = acks.arm(a.room)
    a.abort_notified = True
    transfer.pop_transferred({"a": KVPoll.Failed})
    assert transfer.deferred == [a]

    prealloc.add(PreallocRequest("b", 2, num_pages=2))
    assert prealloc.pop_preallocated({"b": KVPoll.WaitingForInput}).preallocated == []
    # A prefill write still in flight lands now: into a's held pages, nobody else's.
    pool.page(a.pages[0]).fill_(0xAB)
    acks.ack(a.room, 0, a.generation)
    assert transfer.resolve_deferred_releases() == []
    assert prealloc.pop_preallocated({"b": KVPoll.WaitingForInput}).preallocated == []
    acks.ack(a.room, 1, a.generation)
    assert transfer.resolve_deferred_releases() == [a]
    (b,) = prealloc.pop_preallocated({"b": KVPoll.WaitingForInput}).preallocated
    assert b.pages == (0, 1)
    assert b.metadata_slot is not None
    assert table.is_zero(b.metadata_slot)
