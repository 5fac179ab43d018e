"""Metadata slots: the small per-request rows the prefill side writes beside the KV."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import InternalError
from .._numbers import whole

__all__ = ["MetadataRow", "MetadataSlotAllocator"]


@dataclass(frozen=True, slots=True)
class MetadataRow:
    """One metadata slot as read back on the decode side.

    ``room`` is the writer's tag: the prefill side writes the request's room into it, last,
    so a row whose tag is ``0`` has not landed yet and a row whose tag names another room
    belongs to someone else (an index collision).
    """

    room: int
    first_token_id: int
    cached_tokens: int
    #: A checksum of the request's KV pages; ``0`` means the writer sent none.
    checksum: int


class MetadataSlotAllocator:
    """Hands out metadata slot indices ``0 .. size-1``.

    Freed slots are reused in FIFO order: the slot freed longest ago is handed out first, which
    keeps a late write aimed at a freed slot as far as possible from its next owner.

    :param size: how many slots there are.
    :param zero_slot: called with a slot's index while it is being freed, *before* the index
        can be handed out again. Give it the function that clears the slot's row (its writer
        tag above all), so no new owner ever reads a previous owner's tag. If it raises, the
        slot stays allocated (leaked rather than reused dirty) and the error propagates.

    Every method is synchronous.
    """

    __slots__ = ("_free", "_is_free", "_size", "_zero_slot")

    def __init__(self, size: int, *, zero_slot: Callable[[int], None] | None = None) -> None:
        whole("size", size)
        self._size = size
        self._zero_slot = zero_slot
        self._free: deque[int] = deque(range(size))
        # Indexed by slot; catches double frees in O(1).
        self._is_free = bytearray(b"\x01" * size)

    @property
    def size(self) -> int:
        """How many slots there are in all."""
        return self._size

    def available(self) -> int:
        """How many slots can be allocated right now."""
        return len(self._free)

    def is_allocated(self, index: int) -> bool:
        """Whether ``index`` is a valid slot that is handed out right now."""
        return 0 <= index < self._size and not self._is_free[index]

    def alloc(self) -> int | None:
        """Take the slot freed longest ago, or ``None`` if every slot is in use."""
        if not self._free:
            return None
        index = self._free.popleft()
        self._is_free[index] = 0
        return index

    def free(self, index: int) -> None:
        """Zero slot ``index`` (through ``zero_slot``) and make it allocatable again.

        :raises InternalError: if ``index`` is out of range or not allocated (a double free).
        """
        if isinstance(index, bool) or not isinstance(index, int):
            raise InternalError(f"metadata slot {index!r} is not an integer")
        if not 0 <= index < self._size:
            raise InternalError(f"metadata slot {index} is out of range [0, {self._size})")
        if self._is_free[index]:
            raise InternalError(f"metadata slot {index} freed twice")
        if self._zero_slot is not None:
            self._zero_slot(index)
        self._is_free[index] = 1
        self._free.append(index)
