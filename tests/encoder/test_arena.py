"""The staging arena's buddy allocator and its byte buffer, as pure bookkeeping."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from encdisagg.encoder._staging._arena import BuddyAllocator, StagingArena

from .._device import chosen_device

MIN_BLOCK = 16

#: An operation: allocate that many bytes, or free the live block at that index (mod).
Op = tuple[str, int]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 20 * MIN_BLOCK)),
        st.tuples(st.just("free"), st.integers(0, 63)),
    ),
    max_size=60,
)


def fits_somewhere(blocks: dict[int, int], size: int, capacity: int) -> bool:
    """Whether some ``size``-aligned range of ``size`` bytes is free."""
    return any(
        all(start + size <= offset or offset + length <= start for offset, length in blocks.items())
        for start in range(0, capacity - size + 1, size)
    )


def check(allocator: BuddyAllocator, blocks: dict[int, int]) -> None:
    spans = sorted(blocks.items())
    for (offset, size), (next_offset, _) in itertools.pairwise(spans):
        assert offset + size <= next_offset, "blocks overlap"
    for offset, size in spans:
        assert offset >= 0
        assert offset + size <= allocator.capacity
        assert offset % size == 0, "a block is not aligned to its size"
    assert allocator.used_bytes == sum(blocks.values())
    assert allocator.allocated == len(blocks)


@settings(max_examples=200, deadline=None)
@given(capacity_blocks=st.integers(1, 40), operations=ops)
def test_random_allocations_never_overlap_and_merge_back(
    capacity_blocks: int, operations: list[Op]
) -> None:
    allocator = BuddyAllocator(capacity_blocks * MIN_BLOCK, min_block=MIN_BLOCK)
    capacity = allocator.capacity
    # Rounded down to a power of two blocks, never above what was asked.
    assert capacity <= capacity_blocks * MIN_BLOCK < 2 * capacity
    assert capacity // MIN_BLOCK & (capacity // MIN_BLOCK - 1) == 0
    blocks: dict[int, int] = {}
    for kind, value in operations:
        if kind == "alloc":
            size = allocator.block_size(value)
            assert size >= max(value, 1)
            assert size < 2 * max(value, MIN_BLOCK)
            offset = allocator.alloc(value)
            # Buddies merge eagerly, so an aligned free range is always found.
            if offset is None:
                assert size > capacity or not fits_somewhere(blocks, size, capacity)
            else:
                assert offset not in blocks
                blocks[offset] = size
        elif blocks:
            offset = sorted(blocks)[value % len(blocks)]
            allocator.free(offset)
            del blocks[offset]
        check(allocator, blocks)
    for offset in list(blocks):
        allocator.free(offset)
        del blocks[offset]
        check(allocator, blocks)
    assert allocator.alloc(capacity) == 0
    assert allocator.used_bytes == capacity


def test_a_double_free_raises_key_error() -> None:
    allocator = BuddyAllocator(4 * MIN_BLOCK, min_block=MIN_BLOCK)
    offset = allocator.alloc(MIN_BLOCK)
    assert offset is not None
    allocator.free(offset)
    with pytest.raises(KeyError):
        allocator.free(offset)
    with pytest.raises(KeyError):
        allocator.free(MIN_BLOCK * 3)
    assert allocator.used_bytes == 0
    assert allocator.alloc(4 * MIN_BLOCK) == 0


def test_a_capacity_below_one_block_is_refused() -> None:
    with pytest.raises(ValueError):
        BuddyAllocator(MIN_BLOCK - 1, min_block=MIN_BLOCK)


def test_alloc_past_capacity_or_when_full_returns_none() -> None:
    allocator = BuddyAllocator(4 * MIN_BLOCK, min_block=MIN_BLOCK)
    assert allocator.alloc(4 * MIN_BLOCK + 1) is None
    assert allocator.alloc(2 * MIN_BLOCK) is not None
    assert allocator.alloc(MIN_BLOCK + 1) is not None
    assert allocator.alloc(1) is None
    assert allocator.used_bytes == allocator.capacity


# -- StagingArena -----------------------------------------------------------------------------


@pytest.mark.device
def test_stage_copies_into_a_view_of_the_same_shape_and_dtype() -> None:
    device = chosen_device()
    arena = StagingArena(8 * 4096, device)
    source = torch.arange(12 * 5, dtype=torch.float16, device=device).reshape(12, 5)
    expected = source.clone()
    offset = arena.stage(source)
    assert offset is not None
    view = arena.view(offset, source.numel() * source.element_size(), source.dtype, (12, 5))
    assert view.shape == source.shape
    assert view.dtype == source.dtype
    assert view.data_ptr() == arena.ptr + offset
    assert torch.equal(view, expected)
    # A copy: the source may change (or go) without touching the staged bytes.
    source.fill_(-1)
    assert torch.equal(view, expected)
    assert arena.allocated == 1
    arena.free(offset)
    assert arena.allocated == 0


@pytest.mark.device
def test_stage_of_a_non_contiguous_tensor_copies_its_values() -> None:
    device = chosen_device()
    arena = StagingArena(4096, device)
    source = torch.arange(6 * 4, dtype=torch.float32, device=device).reshape(6, 4).t()
    offset = arena.stage(source)
    assert offset is not None
    view = arena.view(offset, source.numel() * source.element_size(), source.dtype, (4, 6))
    assert view.is_contiguous()
    assert torch.equal(view, source)


@pytest.mark.device
def test_stage_returns_none_when_the_arena_is_full() -> None:
    device = chosen_device()
    arena = StagingArena(2 * 4096, device)
    block = torch.ones(4096, dtype=torch.uint8, device=device)
    first = arena.stage(block)
    second = arena.stage(block)
    assert first is not None
    assert second is not None
    assert first != second
    assert arena.stage(block) is None
    assert arena.stage(torch.ones(3 * 4096, dtype=torch.uint8, device=device)) is None
    arena.free(first)
    assert arena.stage(block) is not None
    assert arena.allocated == 2


@pytest.mark.device
def test_stage_returns_none_for_a_tensor_on_another_device() -> None:
    arena = StagingArena(4096, chosen_device())
    assert arena.stage(torch.empty(4, dtype=torch.float16, device="meta")) is None
    assert arena.allocated == 0


@pytest.mark.device
def test_arena_capacity_is_the_allocator_s() -> None:
    arena = StagingArena(3 * 4096, chosen_device())
    assert arena.capacity == 2 * 4096
    assert arena.buffer.numel() == arena.capacity
    assert arena.buffer.dtype == torch.uint8


def test_host_bytes_are_the_staged_block_itself_without_a_copy() -> None:
    arena = StagingArena(64 * 1024, torch.device("cpu"), min_block=4096)
    tensor = torch.arange(16 * 8, dtype=torch.float16).reshape(16, 8)
    nbytes = tensor.numel() * tensor.element_size()
    offset = arena.stage(tensor)
    assert offset is not None
    view = arena.host_bytes(offset, nbytes)
    assert view is not None
    assert view.nbytes == nbytes
    assert bytes(view) == tensor.numpy().tobytes()
    # A view of the arena's memory, not a copy: a later write into the block shows in it.
    arena.view(offset, nbytes, torch.float16, (16, 8)).fill_(1.0)
    assert bytes(view) == torch.ones(16, 8, dtype=torch.float16).numpy().tobytes()
