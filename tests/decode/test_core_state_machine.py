"""A Hypothesis state machine over the synchronous decode core (rules 15-18), run once per
policy for a held request whose release timeout runs out (reused, or retired)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from encdisagg.decode import (
    AbortAckTracker,
    CommitStatus,
    DecodeRequest,
    DecodeTransferQueue,
    KVPoll,
    KVSink,
    MetadataSlotAllocator,
    PageAllocator,
)
from encdisagg.transfer import HoldPolicy

from ._fakes import FakeClock

TIMEOUT = 30.0
ROOMS = (1, 2, 3)
RANKS = (0, 1, 2)
SLOTS = 6
PAGES = 10
# Failures and successes are what moves the queue; keep them likely.
POLLS = st.sampled_from([KVPoll.Failed, KVPoll.Success, None]) | st.sampled_from(KVPoll)
# Steps that cross the deadline (from one side or the other) matter most.
STEPS = st.sampled_from([0.5, 10.0, 29.5, 30.0]) | st.floats(0, 45)


class RecordingTracker(AbortAckTracker):
    """Remembers every generation it issued, per room."""

    def __init__(self) -> None:
        super().__init__()
        self.issued: dict[int, list[int]] = {}

    def arm(self, room: int) -> int:
        generation = super().arm(room)
        self.issued.setdefault(room, []).append(generation)
        return generation


@dataclass
class ModelSink(KVSink):
    """A KV sink that checks every release against the model."""

    machine: DecodeCoreMachine
    results: dict[str, CommitStatus] = field(default_factory=dict)
    failing: set[str] = field(default_factory=set)

    def commit(self, req: DecodeRequest) -> CommitStatus:
        return self.results.get(req.rid, CommitStatus.COMMITTED)

    def release(self, req: DecodeRequest) -> None:
        self.machine.on_release(req)
        if req.rid in self.failing:
            raise RuntimeError(f"release of {req.rid} failed")
        self.machine.pages.free(req.pages)

    def abort(self, req: DecodeRequest, message: str) -> None:
        self.machine.aborted.add(req.rid)


class DecodeCoreMachine(RuleBasedStateMachine):
    #: What the queue does with a held request once its deadline passed without every ack.
    on_timeout = HoldPolicy.REUSE

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.acks = RecordingTracker()
        self.slots = MetadataSlotAllocator(SLOTS, zero_slot=self.on_zero)
        self.pages = PageAllocator(PAGES)
        self.sink = ModelSink(self)
        self.queue = DecodeTransferQueue(
            kv=self.sink,
            slots=self.slots,
            acks=self.acks,
            release_timeout_s=TIMEOUT,
            clock=self.clock,
            on_timeout=self.on_timeout,
        )
        self.requests: list[DecodeRequest] = []
        self.committed: list[DecodeRequest] = []
        self.released: list[str] = []
        self.aborted: set[str] = set()
        # Accepted acks per (room, generation): the model's view of who drained what.
        self.credited: dict[tuple[int, int], set[int]] = {}
        self.held_at: dict[str, float] = {}
        self.violations: list[str] = []

    # -- hooks the core calls -------------------------------------------------------------------

    def on_zero(self, slot: int) -> None:
        if not self.slots.is_allocated(slot):
            self.violations.append(f"slot {slot} zeroed after it was freed")

    def on_release(self, req: DecodeRequest) -> None:
        if req.rid in self.released:
            self.violations.append(f"{req.rid} released twice")
        if any(not self.pages.is_allocated(page) for page in req.pages):
            self.violations.append(f"{req.rid}'s pages were freed already")
        held_at = self.held_at.get(req.rid)
        if held_at is not None:
            assert req.generation is not None
            drained = self.credited.get((req.room, req.generation), set())
            # Retired memory comes back only with proof; reused memory also at its deadline.
            expired = self.clock.now >= held_at + TIMEOUT and self.on_timeout is HoldPolicy.REUSE
            if len(drained) < req.required_acks and not expired:
                self.violations.append(
                    f"{req.rid} released with {len(drained)}/{req.required_acks} acks "
                    f"under {self.on_timeout.value}"
                )
        self.released.append(req.rid)

    @initialize(rooms=st.lists(st.sampled_from(ROOMS), min_size=1, max_size=3))
    def start_with_some_requests(self, rooms: list[int]) -> None:
        for room in rooms:
            self.add(room=room, required=2, num_pages=1)

    # -- rules ----------------------------------------------------------------------------------

    @precondition(lambda self: self.slots.available() > 0)
    @rule(
        room=st.sampled_from(ROOMS),
        required=st.integers(1, len(RANKS)),
        num_pages=st.integers(0, 2),
    )
    def add(self, room: int, required: int, num_pages: int) -> None:
        pages = self.pages.alloc(num_pages)
        if pages is None:
            return
        slot = self.slots.alloc()
        req = DecodeRequest(f"r{len(self.requests)}", room, slot, required, pages=pages)
        self.requests.append(req)
        self.queue.add(req)

    @precondition(lambda self: any(not r.abort_notified for r in self.queue.queue))
    @rule(data=st.data(), arm_first=st.booleans())
    def notify_abort(self, data: st.DataObject, arm_first: bool) -> None:
        req = data.draw(st.sampled_from([r for r in self.queue.queue if not r.abort_notified]))
        if arm_first:
            req.generation = self.acks.arm(req.room)
        req.abort_notified = True

    @precondition(lambda self: bool(self.queue.queue))
    @rule(data=st.data(), status=st.sampled_from(CommitStatus), fail_release=st.booleans())
    def script(self, data: st.DataObject, status: CommitStatus, fail_release: bool) -> None:
        req = data.draw(st.sampled_from(self.queue.queue))
        self.sink.results[req.rid] = status
        if fail_release:
            self.sink.failing.add(req.rid)

    @precondition(lambda self: bool(self.queue.queue))
    @rule(data=st.data(), check_all=st.booleans())
    def pop_transferred(self, data: st.DataObject, check_all: bool) -> None:
        polls = {
            req.rid: poll
            for req in self.queue.queue
            if (poll := data.draw(POLLS, label=f"poll {req.rid}")) is not None
        }
        checked = (
            None
            if check_all
            else data.draw(st.sets(st.sampled_from([r.rid for r in self.queue.queue])))
        )
        self._pop(polls, checked)

    @precondition(lambda self: bool(self.queue.queue))
    @rule(data=st.data(), arm_first=st.booleans())
    def client_abort(self, data: st.DataObject, arm_first: bool) -> None:
        """The whole abort path at once: arm (or not), tell the prefill, see it fail."""
        req = data.draw(st.sampled_from(self.queue.queue))
        if arm_first and not req.abort_notified:
            req.generation = self.acks.arm(req.room)
        req.abort_notified = True
        self._pop({req.rid: KVPoll.Failed}, [req.rid])

    def _pop(self, polls: dict[str, KVPoll], checked: Collection[str] | None) -> None:
        before = list(self.queue.queue)
        held_before = set(map(id, self.queue.deferred))

        out = self.queue.pop_transferred(polls, rids_to_check=checked)

        after = self.queue.queue
        survivors = set(map(id, after))
        # One pass, order preserved: the survivors are the old queue, filtered.
        assert after == [r for r in before if id(r) in survivors]
        for req in before:
            examined = checked is None or req.rid in checked
            if not examined or polls.get(req.rid) not in (KVPoll.Failed, KVPoll.Success):
                assert id(req) in survivors, req.rid
        held = {id(r) for r in self.queue.deferred}
        event(f"held after pop {min(len(held), 2)}")
        for req in self.queue.deferred:
            if id(req) not in held_before:
                self.held_at[req.rid] = self.clock.now
        for req in before:
            if id(req) in survivors or polls.get(req.rid) != KVPoll.Failed:
                continue
            # Failed: held (slot kept) if the prefill ranks were told, else released now.
            if req.abort_notified:
                assert id(req) in held, req.rid
                assert req.metadata_slot is not None
            else:
                assert req.rid in self.released, req.rid
                assert id(req) not in held, req.rid
        assert all(polls[r.rid] == KVPoll.Success for r in out)
        self.committed.extend(out)

    @rule(room=st.sampled_from(ROOMS), rank=st.sampled_from(RANKS), data=st.data())
    def ack(self, room: int, rank: int, data: st.DataObject) -> None:
        # Late, duplicate and stale acks included: any generation ever issued, or a bogus one.
        issued = self.acks.issued.get(room, [])
        generation = data.draw(st.sampled_from([*issued, 10_000]))
        current = self.acks.generation(room)
        accepted = self.acks.ack(room, rank, generation)
        assert accepted == (current == generation)
        if accepted:
            # Only ever the latest generation of the room.
            assert generation == issued[-1]
            self.credited.setdefault((room, generation), set()).add(rank)

    @rule(seconds=STEPS)
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def resolve(self) -> None:
        before = list(self.queue.deferred)
        retired_before = [entry.req for entry in self.queue.retired]
        resolution = self.queue.resolve_deferred()
        released = self.queue.resolve_deferred_releases()
        assert released == []  # the first call resolved everything due
        released = list(resolution.released)
        event(f"resolve released {min(len(released), 2)}")
        event(f"resolve retired {min(len(resolution.retired), 2)}")
        assert all(r.rid not in self.sink.failing for r in released)
        remaining = self.queue.deferred
        assert remaining == [r for r in before if r in remaining]
        retired = [entry.req for entry in self.queue.retired]
        if self.on_timeout is HoldPolicy.REUSE:
            assert retired == []
            assert resolution.retired == ()
        else:
            assert resolution.timed_out == ()
            # Newly retired ones join the retired in hold order, behind those retired before.
            assert retired == [
                *(r for r in retired_before if r in retired),
                *resolution.retired,
            ]
            for req in resolution.retired:
                assert req in before
                assert self.clock.now >= self.held_at[req.rid] + TIMEOUT

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def nothing_was_freed_twice_or_early(self) -> None:
        assert self.violations == []

    @invariant()
    def every_request_is_in_exactly_one_place(self) -> None:
        queued = {id(r) for r in self.queue.queue}
        held = {id(r) for r in self.queue.deferred}
        retired = {id(entry.req) for entry in self.queue.retired}
        event(f"held after pop {min(len(held), 2)}")
        committed = {id(r) for r in self.committed}
        released = set(self.released)
        for req in self.requests:
            places = [
                id(req) in queued,
                id(req) in held,
                id(req) in retired,
                id(req) in committed,
                req.rid in released,
            ]
            assert sum(places) == 1, (req.rid, places)

    @invariant()
    def slots_are_held_by_exactly_the_queued_held_and_retired_requests(self) -> None:
        retired = [entry.req for entry in self.queue.retired]
        owners = [r.metadata_slot for r in [*self.queue.queue, *self.queue.deferred, *retired]]
        assert None not in owners
        allocated = [i for i in range(SLOTS) if self.slots.is_allocated(i)]
        assert sorted(owners) == allocated  # type: ignore[type-var]
        assert all(r.metadata_slot is None for r in self.committed)

    @invariant()
    def pages_are_held_by_live_requests_and_failed_releases(self) -> None:
        owners = [
            page
            for req in self.requests
            if req.rid not in self.released or req.rid in self.sink.failing
            for page in req.pages
        ]
        allocated = [p for p in range(PAGES) if self.pages.is_allocated(p)]
        assert sorted(owners) == allocated

    @invariant()
    def held_and_retired_memory_is_nobody_elses(self) -> None:
        kept = [*self.queue.deferred, *(entry.req for entry in self.queue.retired)]
        others = [
            r for r in self.requests if r.rid not in self.released and all(r is not k for k in kept)
        ]
        for req in kept:
            assert req.metadata_slot is not None
            assert self.slots.is_allocated(req.metadata_slot)
            assert all(self.pages.is_allocated(page) for page in req.pages)
            for other in others:
                assert other.metadata_slot != req.metadata_slot, (req.rid, other.rid)
                assert not set(other.pages) & set(req.pages), (req.rid, other.rid)

    @invariant()
    def every_held_or_retired_request_is_counted_once(self) -> None:
        holds = {id(entry.hold) for entry in (*self.queue.held, *self.queue.retired)}
        assert len(holds) == len(self.queue.held) + len(self.queue.retired)
        assert {id(hold) for hold in self.queue.ledger.holds()} == holds
        assert self.queue.retired_pages == sum(len(e.req.pages) for e in self.queue.retired)
        assert self.queue.held_pages == sum(len(e.req.pages) for e in self.queue.held)


class RetiringDecodeCoreMachine(DecodeCoreMachine):
    on_timeout = HoldPolicy.RETIRE


_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestDecodeCore = DecodeCoreMachine.TestCase
TestDecodeCore.settings = _SETTINGS
TestDecodeCoreRetiring = RetiringDecodeCoreMachine.TestCase
TestDecodeCoreRetiring.settings = _SETTINGS
