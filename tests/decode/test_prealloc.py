"""DecodePreallocQueue: in-order admission in one pass (rule 17)."""

from __future__ import annotations

import pytest

from encdisagg import BadRequestError
from encdisagg.decode import (
    DecodePreallocQueue,
    KVPoll,
    MetadataSlotAllocator,
    PageAllocator,
    PreallocRequest,
    RetractedRequest,
)

READY = KVPoll.WaitingForInput


def make_queue(*, pages: int = 8, slots: int = 4) -> DecodePreallocQueue:
    return DecodePreallocQueue(pages=PageAllocator(pages), slots=MetadataSlotAllocator(slots))


def test_one_pass_admits_removes_failed_and_keeps_order() -> None:
    q = make_queue(pages=6)
    skipped = PreallocRequest("skip", 1, num_pages=1)
    failed = PreallocRequest("failed", 2, num_pages=1)
    handshaking = PreallocRequest("wait", 3, num_pages=1)
    fits = PreallocRequest("fits", 4, num_pages=2, required_acks=3)
    blocked = PreallocRequest("blocked", 5, num_pages=6)
    tail = PreallocRequest("tail", 6, num_pages=1)
    for req in (skipped, failed, handshaking, fits, blocked, tail):
        q.add(req)
    polls = {
        "skip": READY,
        "failed": KVPoll.Failed,
        "wait": KVPoll.Bootstrapping,
        "fits": READY,
        "blocked": READY,
        "tail": READY,
    }

    result = q.pop_preallocated(polls, rids_to_check=["failed", "wait", "fits", "blocked"])

    (admitted,) = result.preallocated
    assert (admitted.rid, admitted.room, admitted.required_acks) == ("fits", 4, 3)
    assert admitted.pages == (0, 1)
    assert admitted.metadata_slot == 0
    assert not admitted.abort_notified
    assert admitted.generation is None
    assert result.failed == [failed]
    assert q.queue == [skipped, handshaking, blocked, tail]
    assert q.pages.available() == 4
    assert q.slots.available() == 3


def test_failed_requests_are_removed_even_after_admission_stopped() -> None:
    q = make_queue(pages=2)
    blocked = PreallocRequest("blocked", 1, num_pages=2)
    q.pages.alloc(1)  # memory pressure: blocked no longer fits
    failed = PreallocRequest("failed", 2, num_pages=1)
    tail = PreallocRequest("tail", 3, num_pages=1)
    for req in (blocked, failed, tail):
        q.add(req)
    preallocated, failed_reqs = q.pop_preallocated(
        dict.fromkeys(["blocked", "tail"], READY) | {"failed": KVPoll.Failed}
    )
    assert preallocated == []
    assert failed_reqs == [failed]
    # tail would fit, but must not overtake blocked.
    assert q.queue == [blocked, tail]


def test_missing_slot_blocks_like_missing_pages() -> None:
    q = make_queue(pages=8, slots=1)
    first, second, third = (PreallocRequest(f"r{i}", i + 1, num_pages=1) for i in range(3))
    for req in (first, second, third):
        q.add(req)
    result = q.pop_preallocated(dict.fromkeys(["r0", "r1", "r2"], READY))
    assert [r.rid for r in result.preallocated] == ["r0"]
    assert q.queue == [second, third]
    # Nothing leaked: second was refused before any page was taken.
    assert q.pages.available() == 7


def test_nothing_is_admitted_while_retracted_requests_wait() -> None:
    q = make_queue(pages=4)
    q.retract(RetractedRequest("old", num_pages=8))
    new = PreallocRequest("new", 1, num_pages=1)
    failed = PreallocRequest("failed", 2, num_pages=1)
    q.add(new)
    q.add(failed)
    result = q.pop_preallocated({"new": READY, "failed": KVPoll.Failed})
    assert result.preallocated == []
    assert result.failed == [failed]
    assert q.queue == [new]


def test_a_request_larger_than_the_pool_is_rejected_up_front() -> None:
    q = make_queue(pages=4)
    with pytest.raises(BadRequestError, match="huge") as caught:
        q.add(PreallocRequest("huge", 1, num_pages=5))
    assert caught.value.req_id == "huge"
    assert q.queue == []


def test_resume_retracted_in_one_pass_stops_at_the_first_that_does_not_fit() -> None:
    q = make_queue(pages=4)
    first = RetractedRequest("resume", num_pages=2)
    skipped = RetractedRequest("skip", num_pages=1)
    blocked = RetractedRequest("blocked", num_pages=3)
    after = RetractedRequest("after", num_pages=1)
    for req in (first, skipped, blocked, after):
        q.retract(req)
    resumed, failed = q.resume_retracted(rids_to_check=["resume", "blocked", "after"])
    assert resumed == [first]
    assert failed == []
    assert first.pages == (0, 1)
    assert q.retracted == [skipped, blocked, after]
    assert after.pages == ()
    # With room again, everyone resumes in order.
    q.pages.free(first.pages)
    assert q.resume_retracted().resumed == [skipped, blocked]
    assert q.retracted == [after]


def _broken_reload(pages: tuple[int, ...]) -> None:
    raise RuntimeError(f"reload into {pages} failed")


def test_a_reload_that_raises_fails_that_request_and_the_pass_goes_on() -> None:
    q = make_queue(pages=4)
    ok = RetractedRequest("ok", 1)
    bad = RetractedRequest("bad", 2, reload=_broken_reload)
    tail = RetractedRequest("tail", 1)
    for req in (ok, bad, tail):
        q.retract(req)

    resumed, failed = q.resume_retracted()

    assert resumed == [ok, tail]
    assert failed == [bad]
    assert isinstance(bad.reload_error, RuntimeError)
    assert "failed" in str(bad.reload_error)
    # Its pages went back at once; it holds none and waits no more.
    assert (bad.pages, bad.reload, bad.is_retracted) == ((), None, False)
    assert q.retracted == []
    assert q.pages.available() == 2
    assert not set(ok.pages) & set(tail.pages)
    assert ok.reload_error is None
    assert tail.reload_error is None


def test_a_failed_reload_spends_none_of_the_pool_or_the_budget() -> None:
    q = make_queue(pages=2)
    bad = RetractedRequest("bad", 2, reload=_broken_reload)
    after = RetractedRequest("after", 2)
    q.retract(bad)
    q.retract(after)

    result = q.resume_retracted(max_pages=2)

    assert result.failed == [bad]
    assert result.resumed == [after]
    assert after.pages == (0, 1)  # the very pages bad's reload was handed
    assert q.pages.available() == 0


def test_an_interrupt_in_a_reload_gives_its_pages_back_and_keeps_the_rest_queued() -> None:
    q = make_queue(pages=4)

    def interrupted(pages: tuple[int, ...]) -> None:
        raise KeyboardInterrupt

    ok = RetractedRequest("ok", 1)
    bad = RetractedRequest("bad", 1, reload=interrupted)
    tail = RetractedRequest("tail", 1)
    for req in (ok, bad, tail):
        q.retract(req)

    with pytest.raises(KeyboardInterrupt):
        q.resume_retracted()

    assert q.retracted == [bad, tail]
    assert (bad.pages, bad.reload, bad.is_retracted) == ((), interrupted, True)
    # What the pass settled before the interrupt is marked in place for the caller to take.
    assert (ok.pages, ok.is_retracted) == ((0,), False)
    assert q.pages.available() == 3
