"""The request table and its records, without an event loop: a fake clock drives time.

A Hypothesis state machine plays the lifecycle's calls in any order against a small model
of what the table must answer; a few plain tests pin the rules down one by one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from encdisagg import EncodeRequest, InternalError, NotFoundError, RequestNotActiveError
from encdisagg.encoder._table import Phase, RequestRecord, RequestTable

REMEMBER_S = 10.0
ABANDON_TTL_S = 4.0
LIMIT = 3
#: More ids than ``LIMIT``, so the bound on remembered ids is reached.
IDS = tuple("abcdefg")


class FakeJob:
    """Stands for a job: the record only counts it and may cancel it."""

    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_table(clock: FakeClock, *, limit: int = LIMIT) -> RequestTable:
    return RequestTable(clock, remember_s=REMEMBER_S, abandon_ttl_s=ABANDON_TTL_S, limit=limit)


def request(req_id: str) -> EncodeRequest:
    return EncodeRequest(req_id, [1])


class _Remembered:
    """What the table must remember of ids: insertion-ordered expiry times, at most
    ``limit`` of them, the oldest forgotten first. Expiry times grow with insertion (one
    TTL, a clock that only advances), so the oldest entries are also the first to expire."""

    def __init__(self, ttl: float, limit: int) -> None:
        self._ttl = ttl
        self._limit = limit
        self._entries: OrderedDict[str, float] = OrderedDict()

    def add(self, key: str, now: float) -> None:
        self._entries[key] = now + self._ttl
        self._entries.move_to_end(key)
        while len(self._entries) > self._limit:
            self._entries.popitem(last=False)

    def discard(self, key: str) -> None:
        self._entries.pop(key, None)

    def holds(self, key: str, now: float) -> bool:
        return self._entries.get(key, -1.0) > now


@dataclass(eq=False)
class _Expected:
    """The model of one live record."""

    record: RequestRecord
    phase: Phase = Phase.ENCODING
    release: bool = False
    error: InternalError | None = None
    jobs: list[FakeJob] = field(default_factory=list)
    delivered: set[str] = field(default_factory=set)

    def must_free(self) -> bool:
        return self.release and not self.jobs and self.phase is not Phase.ENCODING


class TableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.table = make_table(self.clock)
        self.live: dict[str, _Expected] = {}
        self.ended = _Remembered(REMEMBER_S, LIMIT)
        self.ended_errors: dict[str, InternalError | None] = {}
        self.abandoned = _Remembered(ABANDON_TTL_S, LIMIT)
        #: How many times each record object was freed.
        self.frees: dict[int, int] = {}
        self.freed: list[RequestRecord] = []

    # -- helpers ------------------------------------------------------------------------------

    def _free(self, expected: _Expected) -> None:
        """What the lifecycle does when a record says it must be freed."""
        record = expected.record
        # The rule a free must obey, checked against the model, not the record's own word.
        assert expected.release
        assert not expected.jobs
        assert expected.phase is not Phase.ENCODING
        assert self.frees.get(id(record), 0) == 0, "a record was freed twice"
        self.frees[id(record)] = 1
        self.freed.append(record)
        self.table.retire(record)
        assert record.retired
        del self.live[record.req_id]
        self.ended.add(record.req_id, self.clock.now)
        self.ended_errors[record.req_id] = expected.error

    def _live_ids(self) -> list[str]:
        return sorted(self.live)

    # -- rules --------------------------------------------------------------------------------

    @rule(req_id=st.sampled_from(IDS))
    def admit(self, req_id: str) -> None:
        now = self.clock.now
        if req_id in self.live:
            with pytest.raises(RequestNotActiveError):
                self.table.admit(request(req_id))
            return
        if self.abandoned.holds(req_id, now):
            with pytest.raises(RequestNotActiveError):
                self.table.admit(request(req_id))
            # The abandon is used up: the id is remembered as ended, without an error.
            self.abandoned.discard(req_id)
            self.ended.add(req_id, now)
            self.ended_errors[req_id] = None
            return
        record = self.table.admit(request(req_id))
        assert record.phase is Phase.ENCODING
        assert not record.release_requested
        assert record.jobs == 0
        assert record.req_id == req_id
        self.abandoned.discard(req_id)
        self.ended.discard(req_id)
        self.live[req_id] = _Expected(record)

    @rule(req_id=st.sampled_from(IDS))
    def lookup(self, req_id: str) -> None:
        expected = self.live.get(req_id)
        if expected is not None and not expected.release:
            assert self.table.lookup(req_id) is expected.record
        elif expected is not None or self.ended.holds(req_id, self.clock.now):
            with pytest.raises(RequestNotActiveError):
                self.table.lookup(req_id)
        else:
            with pytest.raises(NotFoundError):
                self.table.lookup(req_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def enter_job(self, data: st.DataObject) -> None:
        expected = self.live[data.draw(st.sampled_from(self._live_ids()))]

        job = FakeJob()
        expected.record.enter(job)
        expected.jobs.append(job)

    @precondition(lambda self: any(e.jobs for e in self.live.values()))
    @rule(data=st.data())
    def leave_job(self, data: st.DataObject) -> None:
        busy = sorted(k for k, e in self.live.items() if e.jobs)
        expected = self.live[data.draw(st.sampled_from(busy))]
        job = expected.jobs.pop(data.draw(st.integers(0, len(expected.jobs) - 1)))
        must_free = expected.record.leave(job)
        assert must_free == expected.must_free()
        if must_free:
            self._free(expected)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def request_release(self, data: st.DataObject) -> None:
        expected = self.live[data.draw(st.sampled_from(self._live_ids()))]
        expected.release = True
        must_free = expected.record.request_release()
        assert must_free == expected.must_free()
        if must_free:
            self._free(expected)

    def _encoding(self) -> list[str]:
        return sorted(k for k, e in self.live.items() if e.phase is Phase.ENCODING)

    @precondition(lambda self: self._encoding())
    @rule(data=st.data())
    def stage(self, data: st.DataObject) -> None:
        expected = self.live[data.draw(st.sampled_from(self._encoding()))]
        expected.record.phase = expected.phase = Phase.STAGED

    @precondition(lambda self: self._encoding())
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        # As the lifecycle fails an encode: the error is kept and the request released.
        expected = self.live[data.draw(st.sampled_from(self._encoding()))]
        error = InternalError("boom", req_id=expected.record.req_id)
        record = expected.record
        record.phase = expected.phase = Phase.FAILED
        record.error = expected.error = error
        record.release_requested = expected.release = True

    @precondition(lambda self: self._encoding())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        # The encode's caller left: its failed job releases the request.
        expected = self.live[data.draw(st.sampled_from(self._encoding()))]
        record = expected.record
        record.phase = expected.phase = Phase.ABORTED
        record.release_requested = expected.release = True

    @precondition(lambda self: any(e.phase is Phase.STAGED and e.jobs for e in self.live.values()))
    @rule(data=st.data(), default_count=st.integers(1, 3), endpoint=st.sampled_from("xyz"))
    def deliver(self, data: st.DataObject, default_count: int, endpoint: str) -> None:
        sending = sorted(k for k, e in self.live.items() if e.phase is Phase.STAGED and e.jobs)
        expected = self.live[data.draw(st.sampled_from(sending))]
        expected.record.note_delivered(endpoint, default_count)
        expected.delivered.add(endpoint)
        if len(expected.delivered) >= default_count:
            expected.release = True
        assert expected.record.release_requested == expected.release

    @precondition(lambda self: any(e.phase is Phase.STAGED for e in self.live.values()))
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        # As the deadline keeper expires a staged request: its jobs are cancelled (they
        # leave on their own later) and it is released.
        staged = sorted(k for k, e in self.live.items() if e.phase is Phase.STAGED)
        expected = self.live[data.draw(st.sampled_from(staged))]
        before = [job.cancelled for job in expected.jobs]
        expected.record.cancel_jobs()
        assert [job.cancelled for job in expected.jobs] == [n + 1 for n in before]
        expected.release = True
        must_free = expected.record.request_release()
        assert must_free == expected.must_free()
        if must_free:
            self._free(expected)

    @precondition(lambda self: any(e.must_free() for e in self.live.values()))
    @rule(data=st.data())
    def retire_when_must_free(self, data: st.DataObject) -> None:
        # A release that came without a leave or a release call (a failed encode with no
        # job in): the lifecycle frees it where it notices.
        due = sorted(k for k, e in self.live.items() if e.must_free())
        expected = self.live[data.draw(st.sampled_from(due))]
        assert expected.record.must_free()
        self._free(expected)

    @rule(req_id=st.sampled_from(IDS))
    def abandon(self, req_id: str) -> None:
        now = self.clock.now
        got = self.table.abandon(req_id)
        expected = self.live.get(req_id)
        if expected is not None:
            assert got is expected.record
            # The lifecycle releases what abandon hands back.
            expected.release = True
            if expected.record.request_release():
                assert expected.must_free()
                self._free(expected)
            else:
                assert not expected.must_free()
            return
        assert got is None
        if not self.ended.holds(req_id, now):
            self.abandoned.add(req_id, now)

    @rule(seconds=st.sampled_from([0.5, 1.0, ABANDON_TTL_S, REMEMBER_S, 2 * REMEMBER_S]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.now += seconds

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def records_match_the_model(self) -> None:
        assert len(self.table) == len(self.live)
        for req_id, expected in self.live.items():
            record = expected.record
            assert self.table.get(req_id) is record
            assert not record.retired
            assert record.jobs == len(expected.jobs)
            assert record.phase is expected.phase
            assert record.release_requested == expected.release
            assert record.accepting == (not expected.release)
            assert record.must_free() == expected.must_free()
        for record in self.freed:
            assert record.retired
            assert not record.must_free()
            assert record.jobs == 0

    @invariant()
    def remembered_ids_match_the_model(self) -> None:
        now = self.clock.now
        for req_id in IDS:
            live = req_id in self.live
            ended = not live and self.ended.holds(req_id, now)
            assert self.table.ended(req_id) == ended, req_id
            if ended:
                assert _same_error(self.table.ended_error(req_id), self.ended_errors[req_id])
            else:
                assert self.table.ended_error(req_id) is None
            assert self.table.abandoned(req_id) == self.abandoned.holds(req_id, now), req_id

    @invariant()
    def remembered_ids_stay_bounded(self) -> None:
        assert sum(self.table.ended(i) for i in IDS) <= LIMIT
        assert sum(self.table.abandoned(i) for i in IDS) <= LIMIT
        # The memory itself, not only what is reported: the limit bounds what is kept.
        assert len(self.table._retired) <= LIMIT
        assert len(self.table._abandoned) <= LIMIT


TableMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_table_state_machine = TableMachine.TestCase


# -- the rules one by one ---------------------------------------------------------------------


def test_a_live_id_is_refused_a_second_admit() -> None:
    table = make_table(FakeClock())
    table.admit(request("a"))
    with pytest.raises(RequestNotActiveError):
        table.admit(request("a"))
    assert len(table) == 1


def test_an_abandon_before_the_encode_refuses_exactly_the_next_admit() -> None:
    table = make_table(FakeClock())
    assert table.abandon("a") is None
    assert table.abandoned("a")
    with pytest.raises(NotFoundError):
        table.lookup("a")
    with pytest.raises(RequestNotActiveError):
        table.admit(request("a"))
    # Refused once: remembered as ended, and the retry is admitted.
    assert table.ended("a")
    assert not table.abandoned("a")
    with pytest.raises(RequestNotActiveError):
        table.lookup("a")
    record = table.admit(request("a"))
    assert table.lookup("a") is record


def test_an_abandon_after_a_failure_leaves_the_retry_alone() -> None:
    table = make_table(FakeClock())
    record = table.admit(request("a"))
    error = InternalError("boom", req_id="a")
    record.phase, record.error = Phase.FAILED, error
    assert record.request_release()
    table.retire(record)
    remembered = table.ended_error("a")
    assert _same_error(remembered, error)
    # Remembered detached: no traceback, no cause, so nothing the request held stays alive.
    assert remembered is not None
    assert (remembered.__traceback__, remembered.__cause__) == (None, None)
    assert table.abandon("a") is None
    assert not table.abandoned("a")
    retry = table.admit(request("a"))
    assert retry is not record
    assert retry.phase is Phase.ENCODING
    # The retry forgot what its previous lifecycle left behind.
    assert not table.ended("a")
    assert table.ended_error("a") is None


def test_an_abandon_of_a_live_id_hands_back_its_record() -> None:
    table = make_table(FakeClock())
    record = table.admit(request("a"))
    assert table.abandon("a") is record
    assert not table.abandoned("a")


def test_ended_ids_and_abandons_expire_with_the_clock() -> None:
    clock = FakeClock()
    table = make_table(clock)
    record = table.admit(request("a"))
    record.phase = Phase.STAGED
    assert record.request_release()
    table.retire(record)
    table.abandon("b")
    clock.now += ABANDON_TTL_S
    assert not table.abandoned("b")
    table.admit(request("b"))
    assert table.ended("a")
    clock.now += REMEMBER_S
    assert not table.ended("a")
    with pytest.raises(NotFoundError):
        table.lookup("a")


def test_remembered_ids_are_bounded_oldest_first() -> None:
    clock = FakeClock()
    table = make_table(clock, limit=2)
    for req_id in "abc":
        record = table.admit(request(req_id))
        record.phase = Phase.STAGED
        assert record.request_release()
        table.retire(record)
        clock.now += 0.1
    assert [table.ended(i) for i in "abc"] == [False, True, True]
    for req_id in "xyz":
        table.abandon(req_id)
    assert [table.abandoned(i) for i in "xyz"] == [False, True, True]
    assert len(table._retired) == len(table._abandoned) == 2


def test_the_last_job_out_frees_a_released_record() -> None:
    record = RequestRecord(request("a"))
    encode, send = FakeJob(), FakeJob()
    record.enter(encode)
    record.enter(send)
    assert not record.request_release()
    assert not record.leave(send)
    # The encode job is the last one, but the encode never ended: not yet.
    record.phase = Phase.STAGED
    assert record.leave(encode)
    assert record.running == []
    assert encode.cancelled == send.cancelled == 0


def test_a_record_being_encoded_is_never_freed() -> None:
    record = RequestRecord(request("a"))
    assert not record.request_release()
    assert not record.must_free()
    record.phase = Phase.ABORTED
    assert record.must_free()
    record.retired = True
    assert not record.must_free()


def test_cancel_jobs_calls_every_job_s_cancel() -> None:
    record = RequestRecord(request("a"))
    one, two = FakeJob(), FakeJob()
    record.enter(one)
    record.enter(two)
    record.cancel_jobs()
    assert (one.cancelled, two.cancelled) == (1, 1)
    # Cancelling does not count a job out: it leaves when it ends.
    assert record.jobs == 2


def test_enough_distinct_destinations_release_the_request() -> None:
    record = RequestRecord(request("a"), phase=Phase.STAGED)
    record.note_delivered("x", 2)
    record.note_delivered("x", 2)
    after_one_destination = record.accepting
    record.note_delivered("y", 2)
    assert (after_one_destination, record.accepting) == (True, False)
    fixed = RequestRecord(request("b"), phase=Phase.STAGED, receive_count=1)
    fixed.note_delivered("x", 3)
    assert not fixed.accepting


def _same_error(remembered: object, expected: object) -> bool:
    """The table remembers a detached copy: same type, message and id."""
    if expected is None:
        return remembered is None
    assert isinstance(expected, InternalError)
    return (
        type(remembered) is type(expected)
        and getattr(remembered, "message", None) == expected.message
        and getattr(remembered, "req_id", None) == expected.req_id
    )
