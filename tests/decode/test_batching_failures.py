"""DecodeBatchScheduler: a KV backup or reload that raises fails its request, not the step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from encdisagg.decode import DecodeBatch, FinishReason, RunningRequest, run_decode_step

from .test_batching import Core, make_core, run_step


@dataclass
class ScriptedBackup:
    """A KV backup whose copy is the pages it was taken from; chosen pages fail to copy."""

    failing_backups: set[tuple[int, ...]] = field(default_factory=set)
    failing_restores: set[tuple[int, ...]] = field(default_factory=set)
    interrupted_restores: set[tuple[int, ...]] = field(default_factory=set)
    #: ``(backup, pages)`` of each restore that went through.
    restored: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def backup(self, pages: tuple[int, ...], kv_len: int) -> object:
        if pages in self.failing_backups:
            raise RuntimeError(f"backing up pages {pages} failed")
        return pages

    def restore(self, backup: object, pages: tuple[int, ...]) -> None:
        assert isinstance(backup, tuple)
        if backup in self.failing_restores:
            raise RuntimeError(f"restoring pages {backup} failed")
        if backup in self.interrupted_restores:
            raise KeyboardInterrupt
        self.restored.append((backup, pages))


def scripted(core: Core) -> ScriptedBackup:
    backup = ScriptedBackup()
    core.sched.kv_backup = backup
    return backup


def four_on_four_pages(core: Core) -> list[RunningRequest]:
    """Four requests of 3 prompt tokens on a pool of 4 pages, after their first step: each
    needs a second page now, so the next step retracts the two newest (d, then c)."""
    reqs = core.waiting(4, kv_len=3, max_new_tokens=3)
    run_step(core)
    assert core.pages.available() == 0
    return reqs


def assert_failed_once(core: Core, rr: RunningRequest, cause: str) -> None:
    assert rr.finished is FinishReason.FAILED
    assert cause in rr.error
    assert rr.req.pages == ()
    assert rr.req.metadata_slot is None
    assert rr.rid not in {r.rid for r in core.prealloc.retracted}
    assert rr not in (*core.sched.waiting, *core.sched.running, *core.sched.retracted)


class TestBackupFails:
    def test_the_victim_fails_and_the_step_goes_on_with_its_pages(self) -> None:
        core = make_core(pages=4, max_running=4)
        backup = scripted(core)
        a, b, c, d = four_on_four_pages(core)
        backup.failing_backups.add(d.req.pages)

        batch = run_step(core)

        # d's pages, freed by its failure, count: only c had to be retracted as well.
        assert batch.reqs == (a, b)
        assert_failed_once(core, d, "backing up pages")
        assert core.sched.retracted == [c]
        assert core.sched.take_ended() == [d, a, b]
        # c resumes with its KV reloaded and finishes; every page is back.
        assert run_step(core).reqs == (c,)
        assert c.finished is FinishReason.LENGTH
        assert core.sched.take_ended() == [c]
        assert core.sched.is_idle()
        assert core.pages.available() == core.pages.num_pages

    def test_a_waiting_victim_that_fails_frees_its_slot_once(self) -> None:
        # Two requests whose prompts fill their pages hold the whole pool: the tail is
        # retracted from the waiting queue, still holding its draft slot.
        core = make_core(pages=2, max_running=4)
        backup = scripted(core)
        head, tail = core.waiting(2, kv_len=4, max_new_tokens=2)
        tail_slot = tail.req.metadata_slot
        backup.failing_backups.add(tail.req.pages)

        batch = run_step(core)

        assert batch.reqs == (head,)
        assert_failed_once(core, tail, "backing up pages")
        assert core.h.watch.zeroed.count(tail_slot) == 1
        assert core.h.watch.zeroed_while_free == []
        assert core.sched.take_ended() == [tail, head]
        assert core.sched.schedule_step() is None
        assert core.pages.available() == core.pages.num_pages
        assert core.h.slots.available() == core.h.slots.size

    def test_the_failure_is_logged_with_its_cause(self, caplog: pytest.LogCaptureFixture) -> None:
        core = make_core(pages=4, max_running=4)
        backup = scripted(core)
        *_, d = four_on_four_pages(core)
        backup.failing_backups.add(d.req.pages)

        with caplog.at_level(logging.ERROR, logger="encdisagg.decode"):
            run_step(core)

        [record] = [r for r in caplog.records if d.rid in r.getMessage()]
        assert record.exc_info is not None
        assert isinstance(record.exc_info[1], RuntimeError)
        assert "backing up pages" in str(record.exc_info[1])


class TestReloadFails:
    def test_the_request_fails_and_the_others_resume_in_order(self) -> None:
        # Six requests on six pages: the second step retracts f, e, then d; a, b and c
        # finish with it, and the three resume in retraction order, but e's reload fails.
        core = make_core(pages=6, max_running=6)
        backup = scripted(core)
        a, b, c, d, e, f = core.waiting(6, kv_len=3, max_new_tokens=3)
        run_step(core)
        copies = {rr.rid: rr.req.pages for rr in (d, e, f)}
        assert run_step(core).reqs == (a, b, c)
        assert core.sched.retracted == [f, e, d]
        backup.failing_restores.add(copies[e.rid])

        batch = run_step(core)

        assert batch.reqs == (f, d)
        assert_failed_once(core, e, "restoring pages")
        assert "reload" in e.error
        assert [copy for copy, _ in backup.restored] == [copies[f.rid], copies[d.rid]]
        assert core.sched.take_ended() == [a, b, c, e, f, d]
        assert core.sched.retractions == 3
        assert core.sched.resumptions == 2
        assert core.sched.is_idle()
        assert core.pages.available() == core.pages.num_pages

    def test_a_request_that_never_ran_fails_and_frees_its_slot_once(self) -> None:
        core = make_core(pages=2, max_running=4)
        backup = scripted(core)
        head, tail = core.waiting(2, kv_len=4, max_new_tokens=2)
        tail_slot = tail.req.metadata_slot
        backup.failing_restores.add(tail.req.pages)
        assert run_step(core).reqs == (head,)
        assert core.sched.retracted == [tail]
        assert tail.req.metadata_slot == tail_slot  # the draft state waits for its first step

        # Nothing is left to run, and the step says so instead of raising.
        assert core.sched.schedule_step() is None

        assert_failed_once(core, tail, "restoring pages")
        assert core.h.watch.zeroed.count(tail_slot) == 1
        assert core.h.watch.zeroed_while_free == []
        assert core.sched.take_ended() == [head, tail]
        # An abort that comes late finds it ended: it ends once, not twice.
        core.sched.request_abort(tail)
        assert core.sched.schedule_step() is None
        assert core.sched.take_ended() == []
        assert core.sched.is_idle()
        assert core.pages.available() == core.pages.num_pages
        assert core.h.slots.available() == core.h.slots.size

    def test_the_failure_is_logged_with_its_cause(self, caplog: pytest.LogCaptureFixture) -> None:
        core = make_core(pages=4, max_running=4)
        backup = scripted(core)
        *_, d = four_on_four_pages(core)
        backup.failing_restores.add(d.req.pages)
        run_step(core)

        with caplog.at_level(logging.ERROR, logger="encdisagg.decode"):
            run_step(core)

        [record] = [r for r in caplog.records if d.rid in r.getMessage()]
        assert record.exc_info is not None
        assert "restoring pages" in str(record.exc_info[1])

    def test_an_interrupt_in_a_reload_loses_none_that_resumed_before_it(self) -> None:
        core = make_core(pages=4, max_running=4)
        backup = scripted(core)
        *_, c, d = four_on_four_pages(core)
        backup.interrupted_restores.add(c.req.pages)
        run_step(core)
        assert core.sched.retracted == [d, c]

        with pytest.raises(KeyboardInterrupt):
            core.sched.schedule_step()

        # d resumed before the interrupt and is taken in; c is still in line, holding nothing.
        assert core.sched.running == [d]
        assert core.sched.retracted == [c]
        assert c.req.pages == ()
        assert core.pages.available() + core.sched.owned_pages() == core.pages.num_pages
        backup.interrupted_restores.clear()
        assert run_step(core).reqs == (d, c)
        assert core.sched.is_idle()
        assert core.pages.available() == core.pages.num_pages


@pytest.mark.parametrize("failing", ["backup", "reload"])
@pytest.mark.anyio
async def test_run_decode_step_survives_a_failing_backup_or_reload(failing: str) -> None:
    core = make_core(pages=4, max_running=4)
    backup = scripted(core)
    a, b, c, d = core.waiting(4, kv_len=3, max_new_tokens=3)

    def forward(batch: DecodeBatch) -> list[int]:
        return [5] * len(batch)

    assert await run_decode_step(core.sched, forward) is not None
    (backup.failing_backups if failing == "backup" else backup.failing_restores).add(d.req.pages)

    # The second step retracts d (and c); the third resumes them.
    second = await run_decode_step(core.sched, forward)
    third = await run_decode_step(core.sched, forward)

    assert second is not None
    assert second.reqs == (a, b)
    assert third is not None
    assert third.reqs == (c,)
    assert_failed_once(core, d, "backing up pages" if failing == "backup" else "restoring pages")
    assert d.output == [7, 5]
    assert [rr.finished for rr in (a, b, c)] == [FinishReason.LENGTH] * 3
    assert await run_decode_step(core.sched, forward) is None
    assert core.sched.is_idle()
    assert core.pages.available() == core.pages.num_pages
    assert core.h.slots.available() == core.h.slots.size
