"""A Hypothesis state machine over the decode batch scheduler: pages, slots, retraction."""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from encdisagg.decode import (
    DecodeBatchScheduler,
    DecodePreallocQueue,
    DecodeRequest,
    FinishReason,
    PageAllocator,
    RunningRequest,
)

from ._fakes import FakeClock, make_harness

PAGES = 12
PAGE_TOKENS = 4
MAX_RUNNING = 3
EOS = 2
FIRST = 7


@dataclass
class CheckedBackup:
    """Backs up a request's KV as its page count and length; checks each reload's pages.

    While ``backups_fail`` or ``reloads_fail`` is set, those calls raise instead.
    """

    backups_fail: bool = False
    reloads_fail: bool = False

    def backup(self, pages: tuple[int, ...], kv_len: int) -> object:
        assert len(pages) * PAGE_TOKENS >= kv_len
        if self.backups_fail:
            raise RuntimeError("backup failed")
        return (len(pages), kv_len)

    def restore(self, backup: object, pages: tuple[int, ...]) -> None:
        assert isinstance(backup, tuple)
        if self.reloads_fail:
            raise RuntimeError("reload failed")
        count, kv_len = backup
        # The KV it had, and the page its next token lands on.
        assert len(pages) >= count
        assert len(pages) * PAGE_TOKENS > kv_len


class BatchSchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h = make_harness(slots=32)
        self.pages = PageAllocator(PAGES)
        self.prealloc = DecodePreallocQueue(pages=self.pages, slots=self.h.slots)
        self.backup = CheckedBackup()
        self.sched = DecodeBatchScheduler(
            transfer=self.h.queue,
            prealloc=self.prealloc,
            pages=self.pages,
            page_tokens=PAGE_TOKENS,
            max_running=MAX_RUNNING,
            kv_backup=self.backup,
            eos_token_ids={EOS},
            clock=FakeClock(),
        )
        self.hog: list[int] = []
        self.live: dict[str, RunningRequest] = {}
        self.prompt: dict[str, int] = {}
        #: The tokens each request was given by the steps it took part in.
        self.fed: dict[str, list[int]] = {}
        self.ended: list[RunningRequest] = []
        self.count = 0

    # -- rules ---------------------------------------------------------------------------------

    @rule(
        kv_len=st.integers(1, 12),
        max_new=st.integers(0, 8),
        draft=st.booleans(),
    )
    def commit_a_request(self, kv_len: int, max_new: int, draft: bool) -> None:
        # As the pipeline's admission does: alone in the pool, it must be able to finish.
        if -(-(kv_len + max_new) // PAGE_TOKENS) > PAGES:
            return
        held = self.pages.alloc(-(-kv_len // PAGE_TOKENS))
        if held is None:
            return
        slot = self.h.slots.alloc() if draft else None
        self.count += 1
        rid = f"r{self.count}"
        req = DecodeRequest(rid, self.count, slot, 1, pages=held)
        req.draft = ("draft", rid) if draft else None
        rr = RunningRequest(req, max_new_tokens=max_new, kv_len=kv_len, first_token=FIRST)
        self.sched.add(rr)
        self.live[rid] = rr
        self.prompt[rid] = kv_len
        self.fed[rid] = []

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        batch = self.sched.schedule_step()
        self._collect()
        if batch is None:
            return
        assert len(batch.reqs) <= MAX_RUNNING
        tokens = []
        for rr in batch.reqs:
            assert rr.finished is None
            assert len(rr.req.pages) * PAGE_TOKENS > rr.kv_len, "no page for the next token"
            tokens.append(data.draw(st.sampled_from([5, 6, EOS]), label=rr.rid))
        for rr, token in zip(batch.reqs, tokens, strict=True):
            if not rr.abort_requested:
                self.fed[rr.rid].append(token)
        self.sched.process_batch_result_decode(batch, tokens)
        self._collect()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort_one(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.request_abort(self.live[rid])

    @rule(count=st.integers(1, PAGES))
    def a_transfer_takes_pages(self, count: int) -> None:
        self.hog.extend(self.pages.alloc(min(count, self.pages.available())) or ())

    @precondition(lambda self: self.hog)
    @rule()
    def the_transfer_gives_them_back(self) -> None:
        self.pages.free(self.hog)
        self.hog = []

    @rule(backups_fail=st.booleans(), reloads_fail=st.booleans())
    def kv_copies_start_or_stop_failing(self, backups_fail: bool, reloads_fail: bool) -> None:
        self.backup.backups_fail = backups_fail
        self.backup.reloads_fail = reloads_fail

    def _collect(self) -> None:
        for rr in self.sched.take_ended():
            assert self.live.pop(rr.rid) is rr
            self.ended.append(rr)
            assert rr.req.pages == ()
            assert rr.req.metadata_slot is None
            if rr.finished is FinishReason.FAILED:
                # Nothing else fails here: only a KV backup or reload that raised.
                assert "retraction failed: RuntimeError" in rr.error, rr.error
            if rr.finished in (FinishReason.LENGTH, FinishReason.STOP):
                expected = [FIRST, *self.fed[rr.rid]] if rr.max_new_tokens else []
                assert rr.output == expected
                if rr.finished is FinishReason.STOP:
                    assert rr.output[-1] == EOS
                else:
                    assert len(rr.output) == rr.max_new_tokens

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def every_page_has_one_owner(self) -> None:
        sched = self.sched
        owned = [p for rr in (*sched.waiting, *sched.running) for p in rr.req.pages]
        assert len(owned) == len(set(owned))
        assert not set(owned) & set(self.hog)
        assert self.pages.available() + len(owned) + len(self.hog) == PAGES

    @invariant()
    def slots_are_held_only_by_unconsumed_draft_states(self) -> None:
        held = [rr for rr in self.live.values() if rr.req.metadata_slot is not None]
        assert all(rr.req.draft is not None and rr.steps == 0 for rr in held)
        assert self.h.slots.size - self.h.slots.available() == len(held)

    @invariant()
    def each_live_request_is_in_exactly_one_place(self) -> None:
        sched = self.sched
        places = [rr.rid for rr in (*sched.waiting, *sched.running, *sched.retracted)]
        assert sorted(places) == sorted(self.live)
        assert len(sched.running) <= MAX_RUNNING
        assert [r.rid for r in self.prealloc.retracted] == [rr.rid for rr in sched.retracted]
        assert all(rr.req.pages == () for rr in sched.retracted)

    @invariant()
    def kv_grows_by_one_token_per_step(self) -> None:
        for rid, rr in self.live.items():
            assert rr.kv_len == self.prompt[rid] + rr.steps
            assert len(rr.output) <= max(rr.max_new_tokens, 0)

    def teardown(self) -> None:
        # Once the pool is whole again, every request finishes: nothing waits forever.
        self.backup.backups_fail = self.backup.reloads_fail = False
        if self.hog:
            self.pages.free(self.hog)
            self.hog = []
        for _ in range(200):
            if self.sched.is_idle():
                break
            batch = self.sched.schedule_step()
            if batch is not None:
                for rr in batch.reqs:
                    if not rr.abort_requested:
                        self.fed[rr.rid].append(5)
                self.sched.process_batch_result_decode(batch, [5] * len(batch.reqs))
            self._collect()
        assert self.sched.is_idle(), (self.sched.waiting, self.sched.running, self.live)
        assert self.pages.available() == PAGES
        assert self.h.slots.available() == self.h.slots.size


TestBatchScheduler = BatchSchedulerMachine.TestCase
TestBatchScheduler.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
