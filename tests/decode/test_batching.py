"""DecodeBatchScheduler: prebuilt batches, metadata slot lifetimes, retraction and resume."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import torch

from encdisagg.decode import (
    CommitStatus,
    DecodeBatch,
    DecodeBatchScheduler,
    DecodePreallocQueue,
    DecodeRequest,
    DraftLayout,
    FinishReason,
    KVPagePool,
    KVPoll,
    MetadataSlotTable,
    PageAllocator,
    PagedKVBackup,
    RetractedRequest,
    RunningRequest,
    run_decode_step,
    run_decode_step_inline,
)

from ._fakes import FakeClock, Harness, make_harness

EOS = 2
PAGE_TOKENS = 4


@dataclass
class RecordingBackup:
    """A KV backup that records what it copied and restored."""

    backups: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    restores: list[tuple[object, tuple[int, ...]]] = field(default_factory=list)

    def backup(self, pages: tuple[int, ...], kv_len: int) -> object:
        self.backups.append((pages, kv_len))
        return ("backup", len(self.backups))

    def restore(self, backup: object, pages: tuple[int, ...]) -> None:
        self.restores.append((backup, pages))


@dataclass
class Core:
    h: Harness
    pages: PageAllocator
    prealloc: DecodePreallocQueue
    backup: RecordingBackup
    sched: DecodeBatchScheduler
    clock: FakeClock

    def running(
        self, rid: str, *, kv_len: int = 3, max_new_tokens: int = 4, draft: bool = True
    ) -> RunningRequest:
        """A committed request holding the pages of its prompt (and its slot, if drafted)."""
        slot = self.h.slots.alloc()
        assert slot is not None
        pages = self.pages.alloc(-(-kv_len // PAGE_TOKENS))
        assert pages is not None
        req = DecodeRequest(rid, len(rid), slot, 1, pages=pages)
        req.draft = ("draft of", rid) if draft else None
        if not draft:
            self.h.queue.free_metadata(req)
        return RunningRequest(req, max_new_tokens=max_new_tokens, kv_len=kv_len, first_token=7)

    def waiting(self, count: int, **kwargs: Any) -> list[RunningRequest]:
        reqs = [self.running(f"req-{i}", **kwargs) for i in range(count)]
        for rr in reqs:
            self.sched.add(rr)
        return reqs


def make_core(*, pages: int = 64, max_running: int = 4, prepare: object = None) -> Core:
    h = make_harness(slots=32)
    allocator = PageAllocator(pages)
    prealloc = DecodePreallocQueue(pages=allocator, slots=h.slots)
    backup = RecordingBackup()
    clock = FakeClock(100.0)
    sched = DecodeBatchScheduler(
        transfer=h.queue,
        prealloc=prealloc,
        pages=allocator,
        page_tokens=PAGE_TOKENS,
        max_running=max_running,
        kv_backup=backup,
        eos_token_ids={EOS},
        prepare_prebuilt=prepare,  # type: ignore[arg-type]
        clock=clock,
    )
    return Core(h, allocator, prealloc, backup, sched, clock)


def run_step(core: Core, tokens: dict[str, int] | None = None) -> DecodeBatch:
    batch = core.sched.schedule_step()
    assert batch is not None
    picks = tokens or {}
    core.sched.process_batch_result_decode(batch, [picks.get(rr.rid, 5) for rr in batch.reqs])
    return batch


class TestPrebuiltBatch:
    # Seed: get_new_prebuilt_batch_slices_waiting_queue_prefix
    def test_takes_the_waiting_prefix_that_fits_the_free_running_slots(self) -> None:
        core = make_core(max_running=4)
        [first] = core.waiting(1)
        core.sched.process_batch_result_prebuilt(core.sched.get_new_prebuilt_batch() or [])
        assert core.sched.running == [first]
        core.sched.waiting.clear()
        reqs = core.waiting(5)
        slots = [rr.req.metadata_slot for rr in reqs]
        core.clock.advance(1.0)

        batch = core.sched.get_new_prebuilt_batch()

        assert batch == reqs[:3]
        assert core.sched.waiting == reqs[3:]
        for rr in batch:
            assert rr.entered_at == 101.0
            assert rr.output == [7]
        # Draft states are consumed by the first real decode step, not by prebuilding:
        # every slot is still held, so a burst of transfers cannot overwrite them.
        assert [rr.req.metadata_slot for rr in reqs] == slots
        assert all(rr.req.draft is not None for rr in reqs)
        assert core.h.watch.zeroed == []

    # Seed: get_new_prebuilt_batch_keeps_waiting_queue_when_no_capacity
    def test_no_capacity_leaves_the_waiting_queue_untouched(self) -> None:
        prepared: list[list[RunningRequest]] = []
        core = make_core(max_running=2, prepare=prepared.append)
        running = core.waiting(2)
        core.sched.process_batch_result_prebuilt(core.sched.get_new_prebuilt_batch() or [])
        assert core.sched.running == running
        prepared.clear()
        queued = core.waiting(3)

        assert core.sched.get_new_prebuilt_batch() is None

        assert core.sched.waiting == queued
        assert prepared == []
        assert all(rr.entered_at is None and rr.output == [] for rr in queued)

    def test_the_page_pool_bounds_the_prefix(self) -> None:
        # Prompts of 4 tokens fill their page: each needs one more page for its next token.
        core = make_core(pages=5, max_running=8)
        reqs = core.waiting(3, kv_len=4)
        assert core.pages.available() == 2

        batch = core.sched.get_new_prebuilt_batch()

        assert batch == reqs[:2]
        assert core.sched.waiting == reqs[2:]

    # Seed: get_new_prebuilt_batch_frees_metadata_on_prebuilt_error
    def test_a_prebuilt_step_that_raises_frees_the_slots_of_its_batch(self) -> None:
        def fail(batch: list[RunningRequest]) -> None:
            raise RuntimeError("prebuilt failed")

        core = make_core(prepare=fail)
        [rr] = core.waiting(1)
        slot = rr.req.metadata_slot

        with pytest.raises(RuntimeError, match="prebuilt failed"):
            core.sched.get_new_prebuilt_batch()

        assert core.h.watch.zeroed == [slot]
        assert rr.req.metadata_slot is None
        assert rr.req.draft is None
        assert rr.finished is FinishReason.FAILED
        assert core.sched.take_ended() == [rr]
        assert core.pages.available() == core.pages.num_pages

    # Seed: process_batch_result_prebuilt_frees_finished_metadata
    def test_a_request_finished_by_its_prebuilt_step_frees_its_slot(self) -> None:
        core = make_core()
        [done] = core.waiting(1, max_new_tokens=1)
        slot = done.req.metadata_slot

        batch = core.sched.get_new_prebuilt_batch()
        assert batch == [done]
        assert done.finished is FinishReason.LENGTH
        core.sched.process_batch_result_prebuilt(batch)

        assert core.h.watch.zeroed == [slot]
        assert done.req.metadata_slot is None
        assert core.sched.running == []
        assert core.sched.take_ended() == [done]
        assert done.output == [7]
        assert core.pages.available() == core.pages.num_pages


class TestMetadataSlots:
    # Seed: process_batch_result_decode_releases_prebuilt_metadata_after_consume
    def test_the_first_decode_step_consumes_the_draft_and_frees_the_slot(self) -> None:
        core = make_core()
        [rr] = core.waiting(1)
        slot = rr.req.metadata_slot
        batch = core.sched.schedule_step()
        assert batch is not None
        assert batch.reqs == (rr,)
        # Held through the step: the forward reads the draft state from the slot.
        assert rr.req.metadata_slot == slot

        core.sched.process_batch_result_decode(batch, [5])

        assert core.h.watch.zeroed == [slot]
        assert rr.req.metadata_slot is None
        assert rr.req.draft is None
        assert rr.output == [7, 5]
        assert rr.kv_len == 4

    # Seed: free_decode_metadata_index_if_held_releases_once
    def test_freeing_a_slot_twice_is_a_no_op(self) -> None:
        core = make_core()
        rr = core.running("r")
        slot = rr.req.metadata_slot

        assert core.sched.free_metadata_if_held(rr) is True
        assert core.sched.free_metadata_if_held(rr) is False

        assert core.h.watch.zeroed == [slot]
        assert rr.req.metadata_slot is None
        assert rr.req.draft is None


class TestSteps:
    def test_requests_run_until_their_length_or_an_eos_token(self) -> None:
        core = make_core()
        long, stopped = core.waiting(2, max_new_tokens=3)
        run_step(core, {stopped.rid: EOS})
        assert stopped.finished is FinishReason.STOP
        assert stopped.output == [7, EOS]
        run_step(core)
        assert long.finished is FinishReason.LENGTH
        assert long.output == [7, 5, 5]
        assert core.sched.take_ended() == [stopped, long]
        assert core.sched.schedule_step() is None
        assert core.sched.is_idle()
        assert core.pages.available() == core.pages.num_pages
        assert core.h.slots.available() == core.h.slots.size

    def test_a_request_grows_into_a_new_page_before_its_token_lands(self) -> None:
        core = make_core()
        [rr] = core.waiting(1, kv_len=4, max_new_tokens=3)
        assert len(rr.req.pages) == 1
        run_step(core)
        assert len(rr.req.pages) == 2  # token 4 lands on the second page

    def test_an_abort_during_a_step_ends_the_request_after_it(self) -> None:
        core = make_core()
        [rr] = core.waiting(1, max_new_tokens=8)
        batch = core.sched.schedule_step()
        assert batch is not None
        core.sched.request_abort(rr)
        core.sched.process_batch_result_decode(batch, [5])
        assert rr.finished is FinishReason.ABORTED
        assert rr.output == [7]
        assert core.pages.available() == core.pages.num_pages

    def test_a_failed_step_fails_its_batch(self) -> None:
        core = make_core()
        reqs = core.waiting(2)
        batch = core.sched.schedule_step()
        assert batch is not None
        core.sched.fail_batch(batch, "boom")
        assert [rr.finished for rr in reqs] == [FinishReason.FAILED] * 2
        assert core.h.slots.available() == core.h.slots.size
        assert core.pages.available() == core.pages.num_pages


class TestRetraction:
    def test_the_newest_running_requests_are_retracted_when_the_pool_runs_short(self) -> None:
        # Four pages, four requests of 3 prompt tokens on one page each: the first step fits,
        # but then each needs a second page, and only the pages of two requests are left.
        core = make_core(pages=4, max_running=4)
        a, b, c, d = core.waiting(4, kv_len=3, max_new_tokens=3)
        pages = {rr.rid: rr.req.pages for rr in (c, d)}
        run_step(core)
        assert core.pages.available() == 0

        batch = run_step(core)

        assert batch.reqs == (a, b)
        assert core.sched.retracted == [d, c]
        assert core.backup.backups == [(pages[d.rid], 4), (pages[c.rid], 4)]
        assert c.req.pages == ()
        assert d.req.pages == ()
        assert c.output == d.output == [7, 5]
        # While retracted requests wait, the prealloc queue admits no new request.
        assert [r.rid for r in core.prealloc.retracted] == [d.rid, c.rid]

    def test_retracted_requests_resume_fifo_with_their_kv_reloaded(self) -> None:
        core = make_core(pages=4, max_running=4)
        a, b, c, d = core.waiting(4, kv_len=3, max_new_tokens=3)
        run_step(core)
        run_step(core)  # a and b finish; d, then c, were retracted
        assert (a.finished, b.finished) == (FinishReason.LENGTH, FinishReason.LENGTH)
        backups = [("backup", 1), ("backup", 2)]

        batch = run_step(core)

        assert batch.reqs == (d, c)
        assert [backup for backup, _ in core.backup.restores] == backups
        # Each reload went into pages for its 4 tokens of KV and the one it adds next.
        assert [len(pages) for _, pages in core.backup.restores] == [2, 2]
        assert c.output == d.output == [7, 5, 5]
        assert c.retractions == d.retractions == 1
        assert core.sched.retractions == core.sched.resumptions == 2
        assert core.sched.is_idle()
        assert core.pages.available() == 4

    def test_waiting_requests_that_hold_every_page_are_retracted_so_the_head_runs(self) -> None:
        # Two committed requests whose prompts fill their pages hold the whole pool; neither
        # can take the page for its next token until the newest gives its pages up.
        core = make_core(pages=2, max_running=4)
        head, tail = core.waiting(2, kv_len=4, max_new_tokens=2)

        batch = run_step(core)

        assert batch.reqs == (head,)
        assert tail.retractions == 1
        assert head.finished is FinishReason.LENGTH
        # The tail never ran: it resumes into the waiting queue and is prebuilt as usual.
        batch = run_step(core)
        assert batch.reqs == (tail,)
        assert tail.output == [7, 5]
        assert core.pages.available() == 2

    def test_an_aborted_retracted_request_ends_without_resuming(self) -> None:
        core = make_core(pages=4, max_running=4)
        _, _, c, d = core.waiting(4, kv_len=3, max_new_tokens=6)
        run_step(core)
        run_step(core)
        assert core.sched.retracted == [d, c]
        core.sched.request_abort(d)

        run_step(core)

        assert d.finished is FinishReason.ABORTED
        assert d in core.sched.take_ended()
        assert [r.rid for r in core.prealloc.retracted] == [c.rid]
        assert core.sched.retracted == [c]
        assert d.req.metadata_slot is None
        assert core.backup.restores == []

    # Seed: resume_retracted_reqs_compacts_queue_in_one_pass (the KV reload)
    def test_resume_retracted_compacts_the_queue_in_one_pass_and_reloads_kv(self) -> None:
        allocator = PageAllocator(4)
        h = make_harness()
        queue = DecodePreallocQueue(pages=allocator, slots=h.slots)
        loads: list[tuple[str, tuple[int, ...]]] = []

        def reload(rid: str) -> object:
            return lambda pages: loads.append((rid, pages))

        first = RetractedRequest("resume", 2, reload=reload("resume"))  # type: ignore[arg-type]
        skipped = RetractedRequest("skip", 1, reload=reload("skip"))  # type: ignore[arg-type]
        blocked = RetractedRequest("blocked", 8, reload=reload("blocked"))  # type: ignore[arg-type]
        queue.retracted = [first, skipped, blocked]

        resumed, failed = queue.resume_retracted(rids_to_check=["resume", "blocked"])

        assert resumed == [first]
        assert failed == []
        assert first.is_retracted is False
        assert len(first.pages) == 2
        assert loads == [("resume", first.pages)]
        assert queue.retracted == [skipped, blocked]
        assert skipped.is_retracted
        assert blocked.is_retracted

    def test_paged_backup_round_trips_the_pages(self) -> None:
        pool = KVPagePool(4, 16)
        pool.page(1).copy_(torch.arange(16, dtype=torch.uint8))
        pool.page(3).fill_(9)
        backup = PagedKVBackup(pool)
        copy = backup.backup((1, 3), 5)
        pool.buffer.zero_()
        backup.restore(copy, (2, 0))
        assert pool.page(2).tolist() == list(range(16))
        assert pool.page(0).tolist() == [9] * 16
        assert backup.bytes_held == 0


# Seed: pop_transferred_holds_eagle_metadata_slot_until_prebuilt_consumes
def test_pop_transferred_holds_a_drafted_slot_until_the_first_step_consumes_it() -> None:
    layout = DraftLayout(top_k=4, hidden_size=8)
    table = MetadataSlotTable(4, extra_words=layout.words)
    h = make_harness(slots=4)
    slot = h.slots.alloc()
    assert slot is not None
    layout.write(table.extra(slot), torch.tensor([7, 1, 2, 3]), -torch.ones(4), torch.ones(8))
    table.write(slot, room=3, first_token_id=7, cached_tokens=320)

    class DraftSink:
        def commit(self, req: DecodeRequest) -> CommitStatus:
            assert req.metadata_slot is not None
            req.metadata = table.read(req.metadata_slot)
            req.draft = layout.views(table.extra(req.metadata_slot))
            return CommitStatus.COMMITTED

        def release(self, req: DecodeRequest) -> None:
            raise AssertionError("a committed request keeps its KV")

        def abort(self, req: DecodeRequest, message: str) -> None:
            raise AssertionError(message)

    h.queue.kv = DraftSink()
    req = DecodeRequest("eagle", 3, slot, 1)
    h.queue.add(req)

    assert h.queue.pop_transferred({"eagle": KVPoll.Success}) == [req]

    assert h.queue.queue == []
    assert h.watch.zeroed == []
    assert req.metadata_slot == slot
    assert req.metadata is not None
    assert (req.metadata.first_token_id, req.metadata.cached_tokens) == (7, 320)
    # The draft state is read in place: views of the slot's own memory.
    extra = table.extra(slot)
    assert req.draft.top_ids.data_ptr() == extra.data_ptr()
    assert req.draft.hidden.untyped_storage().data_ptr() == table.rows.untyped_storage().data_ptr()
    assert req.draft.top_ids.tolist() == [7, 1, 2, 3]
    h.queue.free_metadata(req)
    assert h.watch.zeroed == [slot]


@pytest.mark.anyio
async def test_run_decode_step_runs_the_forward_off_the_loop_and_applies_it() -> None:
    core = make_core()
    reqs = core.waiting(2, max_new_tokens=2)
    seen: list[tuple[int, ...]] = []

    def forward(batch: DecodeBatch) -> list[int]:
        seen.append(tuple(rr.kv_len for rr in batch.reqs))
        return [5] * len(batch)

    batch = await run_decode_step(core.sched, forward)
    assert batch is not None
    assert seen == [(3, 3)]
    assert [rr.output for rr in reqs] == [[7, 5], [7, 5]]
    assert await run_decode_step(core.sched, forward) is None


@pytest.mark.anyio
async def test_a_cancelled_step_leaves_its_batch_as_before() -> None:
    core = make_core()
    [rr] = core.waiting(1, max_new_tokens=4)
    release = anyio.Event()
    entered = anyio.Event()

    def forward(batch: DecodeBatch) -> list[int]:
        anyio.from_thread.run_sync(entered.set)
        anyio.from_thread.run(release.wait)
        return [5]

    async with anyio.create_task_group() as group:
        group.start_soon(run_decode_step, core.sched, forward)
        await entered.wait()
        group.cancel_scope.cancel()
        release.set()
    assert rr.output == [7]
    assert rr.kv_len == 3
    assert rr.req.metadata_slot is not None  # the draft was not consumed
    assert core.sched.running == [rr]


def test_an_inline_step_runs_the_forward_on_this_thread_without_awaiting() -> None:
    core = make_core()
    [rr] = core.waiting(1, max_new_tokens=2)
    batch = run_decode_step_inline(core.sched, lambda batch: [5])
    assert batch is not None
    assert rr.output == [7, 5]
    assert rr.finished is FinishReason.LENGTH
    assert run_decode_step_inline(core.sched, lambda batch: [5]) is None


def test_an_inline_step_that_raises_fails_its_batch() -> None:
    core = make_core()
    [rr] = core.waiting(1)

    def broken(batch: DecodeBatch) -> list[int]:
        raise RuntimeError("forward broke")

    assert run_decode_step_inline(core.sched, broken) is not None
    assert rr.finished is FinishReason.FAILED
    assert "forward broke" in rr.error
    assert core.h.slots.available() == core.h.slots.size
