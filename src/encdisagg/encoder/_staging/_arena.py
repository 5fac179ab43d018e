"""The staging arena: one buffer registered once, carved into blocks by size class.

Staging an embedding into the arena costs a copy and an allocation, but no registration:
the engine saw the whole buffer once when the Encoder opened. Blocks are handed out by a
buddy allocator (sizes are powers of two from ``min_block``), so freed neighbours merge and
a long-running encoder does not fragment into unusable slivers.

Pure bookkeeping: nothing here touches the engine or awaits.
"""

from __future__ import annotations

import ctypes
from typing import Any, final

import torch

__all__ = ["BuddyAllocator", "StagingArena"]


def _order_for(nbytes: int, min_block: int) -> int:
    blocks = max(1, -(-nbytes // min_block))
    return (blocks - 1).bit_length()


@final
class BuddyAllocator:
    """Offsets into a region of ``min_block * 2**max_order`` bytes.

    :meth:`alloc` returns the offset of a free block of at least ``nbytes`` (or None);
    :meth:`free` gives it back; free buddies are merged before an allocation fails.
    """

    __slots__ = ("_free", "_max_order", "_min_block", "_used", "used_bytes")

    def __init__(self, capacity: int, *, min_block: int = 4096) -> None:
        if capacity < min_block:
            raise ValueError(f"capacity {capacity} is below one block of {min_block} bytes")
        self._min_block = min_block
        self._max_order = (capacity // min_block).bit_length() - 1
        #: Free block offsets per order.
        self._free: list[set[int]] = [set() for _ in range(self._max_order + 1)]
        self._free[self._max_order].add(0)
        #: Order of every allocated block, by offset.
        self._used: dict[int, int] = {}
        self.used_bytes = 0

    @property
    def capacity(self) -> int:
        return self._min_block << self._max_order

    def block_size(self, nbytes: int) -> int:
        """The size of the block ``alloc(nbytes)`` would hand out."""
        return self._min_block << _order_for(nbytes, self._min_block)

    def alloc(self, nbytes: int) -> int | None:
        """A free block of at least ``nbytes``: its offset, or None if none is free."""
        order = _order_for(nbytes, self._min_block)
        if order > self._max_order:
            return None
        offset = self._take(order)
        if offset is None:
            # Freed blocks are merged lazily: merge them all now, then try once more.
            self._coalesce()
            offset = self._take(order)
            if offset is None:
                return None
        self._used[offset] = order
        self.used_bytes += self._min_block << order
        return offset

    def _take(self, order: int) -> int | None:
        free = self._free
        if free[order]:
            return free[order].pop()
        found = order + 1
        while found <= self._max_order and not free[found]:
            found += 1
        if found > self._max_order:
            return None
        offset = free[found].pop()
        while found > order:
            found -= 1
            # Keep the lower half, free the upper one.
            free[found].add(offset + (self._min_block << found))
        return offset

    def free(self, offset: int) -> None:
        """Give back the block at ``offset``. :raises KeyError: not allocated.

        Not merged with its buddy yet: a block of a size that is asked for again and again
        (the common case) is reused as it is, and merging waits until an allocation finds
        no free block of its size."""
        order = self._used.pop(offset)
        self.used_bytes -= self._min_block << order
        self._free[order].add(offset)

    def _coalesce(self) -> None:
        free = self._free
        for order in range(self._max_order):
            size = self._min_block << order
            blocks = free[order]
            for offset in sorted(blocks):
                buddy = offset ^ size
                if offset < buddy and buddy in blocks:
                    blocks.discard(offset)
                    blocks.discard(buddy)
                    free[order + 1].add(offset)

    @property
    def allocated(self) -> int:
        """How many blocks are handed out."""
        return len(self._used)


@final
class StagingArena:
    """A byte buffer on ``device`` and its allocator.

    :meth:`stage` copies a tensor into a free block and returns the block's offset, or None
    when no block is free; :meth:`view` shows a block as a tensor.
    """

    __slots__ = ("_allocator", "_host_bytes", "buffer", "device", "is_cuda", "ptr")

    def __init__(self, capacity: int, device: torch.device, *, min_block: int = 4096) -> None:
        self._allocator = BuddyAllocator(capacity, min_block=min_block)
        self.buffer = torch.empty(self._allocator.capacity, dtype=torch.uint8, device=device)
        self.ptr = int(self.buffer.data_ptr())
        # Read on every staging: plain attributes, not torch property calls.
        self.device = self.buffer.device
        self.is_cuda = self.buffer.is_cuda
        # The whole buffer as bytes, once: a block's bytes are then a slice of it, without
        # a torch call per push. (numpy arrays export the buffer protocol.)
        self._host_bytes: memoryview | None = None
        if self.device.type == "cpu":
            array: Any = self.buffer.numpy()
            self._host_bytes = memoryview(array)

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def allocated(self) -> int:
        return self._allocator.allocated

    def stage(self, tensor: torch.Tensor, nbytes: int | None = None) -> int | None:
        """Copy ``tensor`` (of ``nbytes``, if the caller knows) into a free block: the
        block's offset, or None when no block is free or the tensor lives elsewhere."""
        if nbytes is None:
            nbytes = tensor.numel() * tensor.element_size()
        if tensor.device != self.device:
            return None
        offset = self._allocator.alloc(nbytes)
        if offset is None:
            return None
        if self.is_cuda or not tensor.is_contiguous():
            self.view(offset, nbytes, tensor.dtype, tuple(tensor.shape)).copy_(tensor)
        else:
            # Host to host: one memmove instead of three views and a torch copy.
            ctypes.memmove(self.ptr + offset, tensor.data_ptr(), nbytes)
        return offset

    def view(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The block at ``offset`` as a tensor of ``dtype`` and ``shape``."""
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def host_bytes(self, offset: int, nbytes: int) -> memoryview | None:
        """The block at ``offset`` as a zero-copy byte view, for an arena in host memory
        (None elsewhere). The view keeps the arena's buffer alive while referenced."""
        if self._host_bytes is None:
            return None
        return self._host_bytes[offset : offset + nbytes]

    def free(self, offset: int) -> None:
        self._allocator.free(offset)
