"""What a held request becomes once its release timeout ran out without every drained-ack:
given back to use (``HoldPolicy.REUSE``, the default) or retired (``HoldPolicy.RETIRE``)."""

from __future__ import annotations

import logging

import pytest

from encdisagg.decode import (
    AbortAckTracker,
    DecodeRequest,
    DecodeTransferQueue,
    KVPoll,
    MetadataSlotAllocator,
)
from encdisagg.transfer import HoldPolicy

from ._fakes import FakeClock, Harness, HoldingSink, RecordingSink, make_harness

ROOM = 200


def held(
    on_timeout: HoldPolicy | str,
    *,
    required_acks: int = 1,
    pages: tuple[int, ...] = (4, 5, 6),
    page_bytes: int = 0,
    sink: RecordingSink | None = None,
) -> tuple[Harness, DecodeRequest, int]:
    """A request aborted mid-transfer and held, its prefill ranks told (generation armed)."""
    h = make_harness(on_timeout=on_timeout, page_bytes=page_bytes, sink=sink)
    generation = h.acks.arm(ROOM)
    req = h.request(
        "held",
        ROOM,
        required_acks=required_acks,
        generation=generation,
        abort_notified=True,
        pages=pages,
    )
    h.queue.pop_transferred({"held": KVPoll.Failed})
    assert h.queue.deferred == [req]
    return h, req, generation


class TestTheChoice:
    def test_reuse_is_the_default(self) -> None:
        queue = DecodeTransferQueue(
            kv=RecordingSink(), slots=MetadataSlotAllocator(1), acks=AbortAckTracker()
        )
        assert queue.on_timeout is HoldPolicy.REUSE

    def test_a_policy_is_taken_by_name(self) -> None:
        assert make_harness(on_timeout="retire").queue.on_timeout is HoldPolicy.RETIRE

    def test_another_value_is_refused_naming_the_field(self) -> None:
        with pytest.raises(ValueError, match="on_timeout must be one of 'retire', 'reuse'"):
            make_harness(on_timeout="forget")

    def test_page_bytes_must_not_be_negative(self) -> None:
        with pytest.raises(ValueError, match="page_bytes"):
            make_harness(page_bytes=-1)


class TestReuse:
    def test_the_deadline_gives_pages_and_slot_back_and_lets_the_hold_go(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        h, req, _ = held(HoldPolicy.REUSE, page_bytes=64)
        (entry,) = h.queue.held
        assert not entry.hold.settled
        assert h.queue.held_bytes == 3 * 64
        h.clock.advance(30)
        with caplog.at_level(logging.WARNING, logger="encdisagg.decode"):
            resolution = h.queue.resolve_deferred()
        assert resolution.timed_out == (req,)
        assert resolution.released == (req,)
        assert resolution.retired == resolution.drained == ()
        assert "late write could still land" in caplog.text
        assert h.sink.calls("release") == ["held"]
        assert req.metadata_slot is None
        # Let go by the named policy, not by proof: the reason says which.
        assert entry.hold.settled
        assert "reuse" in (entry.hold.reason or "")
        assert h.queue.retired == ()
        assert h.queue.held_bytes == 0
        assert len(h.queue.ledger) == 0


class TestRetire:
    def test_a_timed_out_entry_keeps_its_pages_and_slot_out_of_use(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        h, req, _ = held(HoldPolicy.RETIRE)
        slot = req.metadata_slot
        h.clock.advance(29.999)
        assert h.queue.resolve_deferred_releases() == []
        assert h.queue.retired == ()
        h.clock.advance(0.001)
        with caplog.at_level(logging.WARNING, logger="encdisagg.decode"):
            assert h.queue.resolve_deferred_releases() == []
        (entry,) = h.queue.retired
        assert entry.req is req
        assert entry.retired_at == 30.0
        assert not entry.hold.settled
        # Not released, its slot neither zeroed nor freed, its room still armed for its acks.
        assert h.sink.calls("release") == []
        assert req.metadata_slot == slot
        assert h.slots.is_allocated(slot)
        assert h.watch.zeroed == []
        assert req.pages == (4, 5, 6)
        assert h.acks.generation(ROOM) == req.generation
        # No longer waiting for a deadline, still counted.
        assert h.queue.deferred == []
        assert h.queue.next_deadline() is None
        assert h.queue.retired_pages == 3
        assert h.queue.held_pages == 0
        assert len(h.queue.ledger) == 1
        assert [r.message for r in caplog.records].count(caplog.records[-1].message) == 1
        assert "retired" in caplog.text

    def test_retirement_is_reported_once_and_logged_once(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        h, req, _ = held(HoldPolicy.RETIRE)
        h.clock.advance(30)
        with caplog.at_level(logging.WARNING, logger="encdisagg.decode"):
            first = h.queue.resolve_deferred()
            h.clock.advance(1000)
            second = h.queue.resolve_deferred()
        assert first.retired == (req,)
        assert first.released == ()
        assert second.retired == second.released == ()
        assert sum("retired" in record.message for record in caplog.records) == 1
        assert h.queue.retired[0].req is req

    def test_a_late_complete_ack_set_releases_it(self) -> None:
        h, req, generation = held(HoldPolicy.RETIRE, required_acks=2)
        slot = req.metadata_slot
        h.clock.advance(31)
        assert h.queue.resolve_deferred().retired == (req,)
        (entry,) = h.queue.retired
        assert h.acks.ack(ROOM, 0, generation)
        assert h.queue.resolve_deferred_releases() == []
        assert h.queue.retired == (entry,)
        assert h.acks.ack(ROOM, 1, generation)
        resolution = h.queue.resolve_deferred()
        assert resolution.drained == (req,)
        assert resolution.released == (req,)
        assert h.sink.calls("release") == ["held"]
        assert h.queue.retired == ()
        assert h.watch.zeroed == [slot]
        assert not h.slots.is_allocated(slot)
        assert ROOM not in h.acks
        assert entry.hold.settled
        assert len(h.queue.ledger) == 0

    def test_nothing_but_its_own_acks_releases_it(self) -> None:
        h, req, generation = held(HoldPolicy.RETIRE, required_acks=2)
        h.clock.advance(30)
        h.queue.resolve_deferred()
        # Acks of a bogus generation, one rank twice, and any amount of time: still retired.
        assert not h.acks.ack(ROOM, 0, generation + 1000)
        h.acks.ack(ROOM, 1, generation)
        h.acks.ack(ROOM, 1, generation)
        for _ in range(3):
            h.clock.advance(10_000)
            assert h.queue.resolve_deferred_releases() == []
        assert h.queue.free_metadata(DecodeRequest("other", 1, None, 1)) is False
        assert [e.req for e in h.queue.retired] == [req]
        assert h.sink.calls("release") == []
        # The room re-armed for another request: this generation can never drain now.
        h.acks.arm(ROOM)
        h.clock.advance(10_000)
        assert h.queue.resolve_deferred_releases() == []
        assert [e.req for e in h.queue.retired] == [req]

    def test_the_queue_never_adopts_a_generation_a_retired_entry_owns(self) -> None:
        h, _first, generation = held(HoldPolicy.RETIRE)
        h.clock.advance(30)
        h.queue.resolve_deferred()
        # Another request of the same room is aborted without arming first.
        second = h.request("second", ROOM, abort_notified=True)
        h.queue.pop_transferred({"second": KVPoll.Failed})
        assert second.generation is not None
        assert second.generation != generation

    def test_a_raising_release_of_a_retired_entry_is_dropped_never_retried(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        h, req, generation = held(HoldPolicy.RETIRE)
        h.sink.failing_releases.add("held")
        h.clock.advance(30)
        h.queue.resolve_deferred()
        h.acks.ack(ROOM, 0, generation)
        with caplog.at_level(logging.ERROR, logger="encdisagg.decode"):
            resolution = h.queue.resolve_deferred()
        assert resolution.failed == (req,)
        assert resolution.released == ()
        assert h.queue.release_failures == 1
        assert h.queue.retired == ()
        assert h.queue.resolve_deferred_releases() == []
        assert h.sink.calls("release") == ["held"]


class TestTheHold:
    def test_each_held_entry_is_counted_with_its_bytes_and_logged_once(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.WARNING, logger="encdisagg.transfer"):
            h, req, generation = held(HoldPolicy.RETIRE, page_bytes=128)
        (entry,) = h.queue.held
        assert entry.hold.nbytes == 3 * 128
        assert h.queue.held_bytes == 3 * 128
        assert h.queue.held_pages == 3
        assert h.queue.ledger.holds() == (entry.hold,)
        assert "'held'" in entry.hold.what
        assert sum("is held" in record.message for record in caplog.records) == 1
        h.acks.ack(ROOM, 0, generation)
        assert h.queue.resolve_deferred().drained == (req,)
        assert entry.hold.settled
        assert "acked" in (entry.hold.reason or "")
        assert h.queue.held_bytes == 0

    def test_a_sink_that_can_hold_is_told_and_sees_the_hold_settle_before_the_release(
        self,
    ) -> None:
        sink = HoldingSink()
        settled_at_release: list[bool] = []
        release = sink.release

        def watching_release(req: DecodeRequest) -> None:
            settled_at_release.append(sink.holds[req.rid].settled)
            release(req)

        sink.release = watching_release  # type: ignore[method-assign]
        h, _req, generation = held(HoldPolicy.RETIRE, sink=sink)
        assert sink.events == [("abort", "held"), ("hold", "held")]
        assert sink.holds["held"] is h.queue.held[0].hold
        h.acks.ack(ROOM, 0, generation)
        h.queue.resolve_deferred()
        assert settled_at_release == [True]

    def test_a_request_released_at_once_is_never_held(self) -> None:
        sink = HoldingSink()
        h = make_harness(on_timeout=HoldPolicy.RETIRE, sink=sink)
        h.request("plain", 5)
        h.queue.pop_transferred({"plain": KVPoll.Failed})
        assert sink.calls("hold") == []
        assert h.queue.ledger.taken == 0


def test_every_clock_reading_is_injected() -> None:
    clock = FakeClock(now=1000.0)
    sink = RecordingSink()
    slots = MetadataSlotAllocator(2)
    acks = AbortAckTracker()
    queue = DecodeTransferQueue(
        kv=sink, slots=slots, acks=acks, clock=clock, release_timeout_s=5, on_timeout="retire"
    )
    req = DecodeRequest("r", 9, slots.alloc(), 1, abort_notified=True)
    queue.add(req)
    queue.pop_transferred({"r": KVPoll.Failed})
    assert queue.next_deadline() == 1005.0
    clock.advance(5)
    assert queue.resolve_deferred().retired == (req,)
    assert queue.retired[0].retired_at == 1005.0
