"""DecodeTransferQueue: one-pass compaction (rule 17) and deferred release (rules 15, 16, 18)."""

from __future__ import annotations

import logging

import pytest

from encdisagg import InternalError
from encdisagg.decode import (
    AbortAckTracker,
    CommitStatus,
    DecodeRequest,
    DecodeTransferQueue,
    KVPoll,
    MetadataSlotAllocator,
)

from ._fakes import FakeClock, Harness, RecordingSink, make_harness


class TestPopTransferred:
    def test_one_pass_commits_fails_and_keeps_in_order(self) -> None:
        h = make_harness()
        pending = h.request("pending", 1)
        done = h.request("done", 2)
        failed = h.request("failed", 3)
        unchecked = h.request("unchecked", 4)
        polls = {
            "pending": KVPoll.Transferring,
            "done": KVPoll.Success,
            "failed": KVPoll.Failed,
            "unchecked": KVPoll.Success,
        }
        slots = {req.rid: req.metadata_slot for req in h.queue.queue}

        transferred = h.queue.pop_transferred(polls, rids_to_check=["pending", "done", "failed"])

        assert transferred == [done]
        assert h.queue.queue == [pending, unchecked]
        assert h.sink.events == [
            ("commit", "done"),
            ("abort", "failed"),
            ("release", "failed"),
        ]
        assert "failed" in h.sink.messages["failed"]
        # Both removed requests had their slots zeroed, then freed, once each.
        assert h.watch.zeroed == [slots["done"], slots["failed"]]
        assert h.watch.zeroed_while_free == []
        assert done.metadata_slot is None
        assert failed.metadata_slot is None
        assert pending.metadata_slot == slots["pending"]
        assert unchecked.metadata_slot == slots["unchecked"]
        assert h.slots.available() == 16 - 2

    def test_every_rid_is_examined_when_rids_to_check_is_none(self) -> None:
        h = make_harness()
        reqs = [h.request(f"r{i}", i + 1) for i in range(6)]
        polls = {f"r{i}": KVPoll.Success for i in range(0, 6, 2)}
        transferred = h.queue.pop_transferred(polls)
        assert transferred == reqs[0::2]
        assert h.queue.queue == reqs[1::2]

    def test_each_request_is_committed_once_per_pass(self) -> None:
        h = make_harness()
        for i in range(4):
            h.request(f"r{i}", i + 1)
        h.sink.results = {f"r{i}": CommitStatus.NOT_READY for i in range(4)}
        h.queue.pop_transferred(dict.fromkeys(["r0", "r1", "r2", "r3"], KVPoll.Success))
        assert h.sink.calls("commit") == ["r0", "r1", "r2", "r3"]

    def test_metadata_not_landed_keeps_the_request_and_its_slot(self) -> None:
        h = make_harness()
        waiting = h.request("waiting", 1)
        slot = waiting.metadata_slot
        h.sink.results["waiting"] = CommitStatus.NOT_READY
        assert h.queue.pop_transferred({"waiting": KVPoll.Success}) == []
        assert h.queue.queue == [waiting]
        assert waiting.metadata_slot == slot
        assert h.watch.zeroed == []
        assert h.sink.calls("release") == []
        # Once the row lands, the next pass commits it.
        h.sink.results["waiting"] = CommitStatus.COMMITTED
        assert h.queue.pop_transferred({"waiting": KVPoll.Success}) == [waiting]
        assert h.watch.zeroed == [slot]

    def test_corrupt_metadata_aborts_releases_and_frees(self) -> None:
        h = make_harness()
        bad = h.request("bad", 1)
        h.sink.results["bad"] = CommitStatus.CORRUPT
        assert h.queue.pop_transferred({"bad": KVPoll.Success}) == []
        assert h.queue.queue == []
        assert h.sink.events == [("commit", "bad"), ("abort", "bad"), ("release", "bad")]
        assert bad.metadata_slot is None
        assert h.slots.available() == 16

    def test_requests_without_a_poll_or_in_progress_stay(self) -> None:
        h = make_harness()
        reqs = [h.request(f"r{i}", i + 1) for i in range(4)]
        polls = {
            "r0": KVPoll.Bootstrapping,
            "r1": KVPoll.WaitingForInput,
            "r2": KVPoll.Transferring,
        }
        assert h.queue.pop_transferred(polls) == []
        assert h.queue.queue == reqs
        assert h.sink.events == []

    def test_failed_after_abort_notified_is_held_with_its_slot(self) -> None:
        h = make_harness()
        generation = h.acks.arm(7)
        req = h.request("aborted", 7, required_acks=2, generation=generation, abort_notified=True)
        slot = req.metadata_slot
        h.clock.now = 100.0
        assert h.queue.pop_transferred({"aborted": KVPoll.Failed}) == []
        assert h.queue.queue == []
        assert h.queue.deferred == [req]
        assert h.sink.events == [("abort", "aborted")]
        (entry,) = h.queue.held
        assert entry.generation == generation
        assert entry.required_acks == 2
        assert entry.deadline == 130.0
        assert h.queue.next_deadline() == 130.0
        assert req.metadata_slot == slot
        assert h.slots.is_allocated(slot)

    def test_a_raising_sink_does_not_break_the_pass(self, caplog: pytest.LogCaptureFixture) -> None:
        class ExplodingSink(RecordingSink):
            def commit(self, req: DecodeRequest) -> CommitStatus:
                super().commit(req)
                if req.rid == "explodes":
                    raise ValueError("unreadable row")
                return CommitStatus.COMMITTED

            def abort(self, req: DecodeRequest, message: str) -> None:
                super().abort(req, message)
                raise RuntimeError("client gone")

        sink = ExplodingSink(failing_releases={"explodes"})
        slots = MetadataSlotAllocator(4)
        queue = DecodeTransferQueue(kv=sink, slots=slots, acks=AbortAckTracker())
        reqs = [DecodeRequest(rid, i + 1, slots.alloc(), 1) for i, rid in enumerate("ab")]
        explodes = DecodeRequest("explodes", 9, slots.alloc(), 1)
        queue.queue = [reqs[0], explodes, reqs[1]]
        with caplog.at_level(logging.ERROR, logger="encdisagg.decode"):
            out = queue.pop_transferred(dict.fromkeys(["a", "explodes", "b"], KVPoll.Success))
        # A raising commit counts as corrupt: aborted and released, the others committed.
        assert out == reqs
        assert queue.queue == []
        assert sink.calls("release") == ["explodes"]
        assert queue.release_failures == 1
        assert slots.available() == 4
        assert "unreadable row" in caplog.text or "committing KV" in caplog.text

    def test_a_double_free_is_an_internal_error_and_keeps_the_queue_consistent(self) -> None:
        h = make_harness()
        first = h.request("first", 1)
        second = h.request("second", 2)
        third = h.request("third", 3)
        # Someone else freed second's slot behind the queue's back.
        assert second.metadata_slot is not None
        h.slots.free(second.metadata_slot)
        with pytest.raises(InternalError, match="freed twice"):
            h.queue.pop_transferred(dict.fromkeys(["first", "second"], KVPoll.Success))
        # What was decided stays decided; what was not reached stays queued.
        assert h.queue.queue == [third]
        assert first.metadata_slot is None


class TestResolveDeferredReleases:
    def hold(
        self, *, required_acks: int = 1, rid: str = "held", room: int = 200
    ) -> tuple[Harness, DecodeRequest, int]:
        h = make_harness()
        generation = h.acks.arm(room)
        req = h.request(
            rid, room, required_acks=required_acks, generation=generation, abort_notified=True
        )
        h.queue.pop_transferred({rid: KVPoll.Failed})
        return h, req, generation

    def test_noop_when_nothing_is_held(self) -> None:
        h = make_harness()
        assert h.queue.resolve_deferred_releases() == []
        assert h.sink.events == []

    def test_held_until_every_rank_acked_then_released_once(self) -> None:
        h, req, generation = self.hold(required_acks=2)
        slot = req.metadata_slot
        assert h.queue.resolve_deferred_releases() == []
        assert h.acks.ack(200, 0, generation)
        assert h.queue.resolve_deferred_releases() == []
        assert h.sink.calls("release") == []
        assert h.slots.is_allocated(slot)
        assert h.acks.ack(200, 1, generation)
        assert h.queue.resolve_deferred_releases() == [req]
        assert h.sink.calls("release") == ["held"]
        assert h.queue.deferred == []
        assert h.watch.zeroed == [slot]
        assert not h.slots.is_allocated(slot)
        assert 200 not in h.acks
        assert h.queue.resolve_deferred_releases() == []
        assert h.sink.calls("release") == ["held"]

    def test_duplicate_acks_from_one_rank_do_not_release(self) -> None:
        h, req, generation = self.hold(required_acks=2)
        for _ in range(3):
            h.acks.ack(200, 0, generation)
        assert h.queue.resolve_deferred_releases() == []
        assert h.queue.deferred == [req]

    def test_released_at_the_deadline_without_acks(self, caplog: pytest.LogCaptureFixture) -> None:
        h, req, _ = self.hold()
        h.clock.advance(29.999)
        assert h.queue.resolve_deferred_releases() == []
        h.clock.advance(0.001)
        with caplog.at_level(logging.WARNING, logger="encdisagg.decode"):
            assert h.queue.resolve_deferred_releases() == [req]
        assert "late write could still land" in caplog.text
        assert h.sink.calls("release") == ["held"]
        assert h.slots.available() == 16
        assert 200 not in h.acks

    def test_late_ack_of_an_earlier_lifetime_does_not_release_a_reused_room(self) -> None:
        h = make_harness()
        first_gen = h.acks.arm(300)
        first = h.request("first", 300, generation=first_gen, abort_notified=True)
        h.queue.pop_transferred({"first": KVPoll.Failed})
        h.clock.advance(30)
        assert h.queue.resolve_deferred_releases() == [first]
        # The room is reused by a new request that is aborted in turn.
        second_gen = h.acks.arm(300)
        second = h.request("second", 300, generation=second_gen, abort_notified=True)
        h.queue.pop_transferred({"second": KVPoll.Failed})
        # The first lifetime's prefill rank acks only now.
        assert not h.acks.ack(300, 0, first_gen)
        assert h.queue.resolve_deferred_releases() == []
        assert h.queue.deferred == [second]
        assert h.acks.ack(300, 0, second_gen)
        assert h.queue.resolve_deferred_releases() == [second]

    def test_room_rearmed_by_another_request_only_times_out(self) -> None:
        h, req, _generation = self.hold()
        # A colliding request re-arms the room and its rank acks: not ours.
        other = h.acks.arm(200)
        h.acks.ack(200, 0, other)
        assert h.queue.resolve_deferred_releases() == []
        h.clock.advance(30)
        assert h.queue.resolve_deferred_releases() == [req]
        # Our release leaves the other request's count alone.
        assert h.acks.generation(200) == other

    def test_a_raising_release_is_isolated_and_never_retried(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        h = make_harness()
        h.request("bad", 701, abort_notified=True, generation=h.acks.arm(701))
        good = h.request("good", 700, abort_notified=True, generation=h.acks.arm(700))
        h.sink.failing_releases.add("bad")
        h.queue.pop_transferred(dict.fromkeys(["bad", "good"], KVPoll.Failed))
        h.clock.advance(31)
        with caplog.at_level(logging.ERROR, logger="encdisagg.decode"):
            released = h.queue.resolve_deferred_releases()
        assert released == [good]
        assert h.sink.calls("release") == ["bad", "good"]
        assert "releasing KV of request 'bad' raised" in caplog.text
        assert h.queue.deferred == []
        assert h.queue.release_failures == 1
        # Both slots freed exactly once; a second pass is a clean no-op.
        assert sorted(h.watch.zeroed) == [0, 1]
        assert h.queue.resolve_deferred_releases() == []
        assert h.sink.calls("release") == ["bad", "good"]

    def test_each_entry_resolves_on_its_own(self) -> None:
        h = make_harness()
        gens = {room: h.acks.arm(room) for room in (1, 2, 3)}
        reqs = [
            h.request(f"r{room}", room, generation=gens[room], abort_notified=True)
            for room in (1, 2, 3)
        ]
        h.queue.pop_transferred(dict.fromkeys(["r1", "r2", "r3"], KVPoll.Failed))
        h.acks.ack(2, 0, gens[2])
        assert h.queue.resolve_deferred_releases() == [reqs[1]]
        assert h.queue.deferred == [reqs[0], reqs[2]]

    def test_failed_without_abort_notified_releases_at_once(self) -> None:
        h = make_harness()
        req = h.request("plain", 5)
        h.queue.pop_transferred({"plain": KVPoll.Failed})
        assert h.queue.deferred == []
        assert h.sink.events == [("abort", "plain"), ("release", "plain")]
        assert req.metadata_slot is None


class TestWhoArms:
    def test_queue_arms_an_unarmed_room_and_acks_of_that_generation_release(self) -> None:
        h = make_harness()
        req = h.request("late", 42, required_acks=1, abort_notified=True)
        h.queue.pop_transferred({"late": KVPoll.Failed})
        assert req.generation is not None
        assert h.acks.generation(42) == req.generation
        assert h.acks.ack(42, 0, req.generation)
        assert h.queue.resolve_deferred_releases() == [req]

    def test_queue_adopts_the_generation_the_abort_path_armed(self) -> None:
        h = make_harness()
        generation = h.acks.arm(43)
        # An ack that raced ahead of the scheduler is kept.
        h.acks.ack(43, 0, generation)
        req = h.request("armed", 43, abort_notified=True)
        h.queue.pop_transferred({"armed": KVPoll.Failed})
        assert req.generation == generation
        assert h.queue.resolve_deferred_releases() == [req]

    def test_queue_does_not_share_a_generation_with_another_held_request(self) -> None:
        h = make_harness()
        first = h.request("first", 44, required_acks=1, abort_notified=True)
        second = h.request("second", 44, required_acks=1, abort_notified=True)
        h.queue.pop_transferred({"first": KVPoll.Failed})
        h.queue.pop_transferred({"second": KVPoll.Failed})
        assert first.generation != second.generation
        assert first.generation is not None
        assert second.generation is not None
        # first's ack can no longer be credited (the room was re-armed): it times out.
        assert not h.acks.ack(44, 0, first.generation)
        assert h.acks.ack(44, 0, second.generation)
        assert h.queue.resolve_deferred_releases() == [second]
        h.clock.advance(30)
        assert h.queue.resolve_deferred_releases() == [first]


def test_release_timeout_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="release_timeout_s"):
        DecodeTransferQueue(
            kv=RecordingSink(),
            slots=MetadataSlotAllocator(1),
            acks=AbortAckTracker(),
            release_timeout_s=-1,
            clock=FakeClock(),
        )
