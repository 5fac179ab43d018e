"""KVPoll, the slot and page allocators, and the abort-ack tracker (rule 16)."""

from __future__ import annotations

import pytest

from encdisagg import InternalError
from encdisagg.decode import AbortAckTracker, KVPoll, MetadataSlotAllocator, PageAllocator

from ._fakes import watched_slots


def test_kvpoll_values_and_order() -> None:
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]
    # Ranks agree on the least advanced state with min(); Failed wins.
    assert min(KVPoll.Success, KVPoll.Transferring, KVPoll.Failed) is KVPoll.Failed


class TestMetadataSlotAllocator:
    def test_fifo_reuse_of_freed_slots(self) -> None:
        slots = MetadataSlotAllocator(3)
        assert [slots.alloc(), slots.alloc(), slots.alloc()] == [0, 1, 2]
        assert slots.alloc() is None
        assert slots.available() == 0
        slots.free(1)
        slots.free(0)
        assert slots.available() == 2
        # The slot freed longest ago comes back first.
        assert [slots.alloc(), slots.alloc()] == [1, 0]

    def test_double_free_and_out_of_range_are_errors(self) -> None:
        slots = MetadataSlotAllocator(2)
        index = slots.alloc()
        assert index == 0
        slots.free(index)
        with pytest.raises(InternalError, match="slot 0 freed twice"):
            slots.free(index)
        with pytest.raises(InternalError, match="slot 1 freed twice"):
            slots.free(1)  # never allocated
        with pytest.raises(InternalError, match="out of range"):
            slots.free(2)
        with pytest.raises(InternalError, match="out of range"):
            slots.free(-1)
        assert slots.available() == 2

    def test_zeroed_before_it_can_be_reused(self) -> None:
        slots, watch = watched_slots(1)
        index = slots.alloc()
        assert index is not None
        slots.free(index)
        assert watch.zeroed == [0]
        assert watch.zeroed_while_free == []

    def test_failed_zeroing_leaks_the_slot_instead_of_reusing_it(self) -> None:
        def broken_zero(slot: int) -> None:
            raise OSError("row not writable")

        slots = MetadataSlotAllocator(1, zero_slot=broken_zero)
        index = slots.alloc()
        assert index is not None
        with pytest.raises(OSError, match="row not writable"):
            slots.free(index)
        assert slots.is_allocated(index)
        assert slots.alloc() is None

    def test_rejects_a_negative_size(self) -> None:
        with pytest.raises(ValueError, match="size"):
            MetadataSlotAllocator(-1)


class TestPageAllocator:
    def test_alloc_all_or_nothing_and_free(self) -> None:
        pages = PageAllocator(4)
        first = pages.alloc(3)
        assert first == (0, 1, 2)
        assert pages.alloc(2) is None
        assert pages.available() == 1
        pages.free(first)
        assert pages.available() == 4
        assert pages.alloc(0) == ()

    def test_double_free_frees_nothing(self) -> None:
        pages = PageAllocator(4)
        taken = pages.alloc(2)
        assert taken == (0, 1)
        with pytest.raises(InternalError, match="page 1 freed twice"):
            pages.free([0, 1, 1])
        # All or nothing: page 0 is still allocated.
        assert pages.is_allocated(0)
        pages.free(taken)
        with pytest.raises(InternalError, match="page 0 freed twice"):
            pages.free([0])
        with pytest.raises(InternalError, match="out of range"):
            pages.free([4])


class TestAbortAckTracker:
    def test_release_safe_after_every_rank_acked(self) -> None:
        acks = AbortAckTracker()
        generation = acks.arm(100)
        assert not acks.is_release_safe(100, 2)
        assert acks.ack(100, 0, generation)
        assert not acks.is_release_safe(100, 2)
        assert acks.ack(100, 1, generation)
        assert acks.is_release_safe(100, 2)
        assert acks.is_release_safe(100, 2, generation=generation)

    def test_single_rank(self) -> None:
        acks = AbortAckTracker()
        generation = acks.arm(7)
        assert acks.ack(7, 0, generation)
        assert acks.is_release_safe(7, 1)

    def test_duplicate_ack_from_one_rank_counts_once(self) -> None:
        acks = AbortAckTracker()
        generation = acks.arm(101)
        assert acks.ack(101, 3, generation)
        assert acks.ack(101, 3, generation)
        assert acks.acked_ranks(101) == {3}
        assert not acks.is_release_safe(101, 2)

    def test_ack_for_an_unarmed_room_is_dropped(self) -> None:
        acks = AbortAckTracker()
        assert not acks.ack(104, 0, 1)
        assert 104 not in acks
        assert not acks.is_release_safe(104, 1)
        # Nor does it linger for the room's next lifetime.
        generation = acks.arm(104)
        assert generation == 1
        assert not acks.is_release_safe(104, 1)

    def test_clear_forgets_the_room(self) -> None:
        acks = AbortAckTracker()
        generation = acks.arm(103)
        acks.ack(103, 0, generation)
        acks.clear(103)
        assert 103 not in acks
        assert len(acks) == 0
        assert not acks.is_release_safe(103, 1)
        assert not acks.ack(103, 1, generation)
        acks.clear(103)  # clearing an unarmed room is a no-op

    def test_late_ack_of_an_earlier_generation_is_not_credited_to_a_reused_room(self) -> None:
        acks = AbortAckTracker()
        first = acks.arm(105)
        assert acks.ack(105, 0, first)
        acks.clear(105)
        # A late ack of the first lifetime, after its release: dropped.
        assert not acks.ack(105, 1, first)
        second = acks.arm(105)
        assert second != first
        # And still dropped once the room is armed again for another request.
        assert not acks.ack(105, 1, first)
        assert acks.ack(105, 0, second)
        assert not acks.is_release_safe(105, 2)
        assert acks.ack(105, 1, second)
        assert acks.is_release_safe(105, 2)

    def test_arming_again_wipes_stale_acks(self) -> None:
        acks = AbortAckTracker()
        first = acks.arm(106)
        acks.ack(106, 0, first)
        acks.ack(106, 1, first)
        assert acks.is_release_safe(106, 2)
        second = acks.arm(106)
        assert acks.generation(106) == second
        assert not acks.is_release_safe(106, 2)
        assert not acks.is_release_safe(106, 0, generation=first)

    def test_generations_never_repeat_across_rooms_and_clears(self) -> None:
        acks = AbortAckTracker()
        seen = []
        for room in (1, 2, 1, 1):
            seen.append(acks.arm(room))
            acks.clear(room)
        assert len(set(seen)) == len(seen)

    def test_generation_scoped_clear_spares_a_newer_generation(self) -> None:
        acks = AbortAckTracker()
        old = acks.arm(9)
        new = acks.arm(9)
        acks.ack(9, 0, new)
        acks.clear(9, generation=old)
        assert acks.generation(9) == new
        assert acks.is_release_safe(9, 1)
        acks.clear(9, generation=new)
        assert 9 not in acks


def test_public_names_are_exported_from_the_package() -> None:
    import encdisagg.decode as decode

    for name in decode.__all__:
        obj = getattr(decode, name)
        if isinstance(obj, type):
            assert obj.__module__ == "encdisagg.decode", name
