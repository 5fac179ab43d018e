"""Bookkeeping of registered memory ranges, shared by the engines."""

from __future__ import annotations

from bisect import bisect_right, insort
from typing import final

from .._errors import TransferError
from .._numbers import whole

__all__ = ["RegionTable", "check_range"]


def check_range(call: str, field: str, ptr: object, nbytes: object) -> tuple[int, int]:
    """Validate an address and a length given to ``call``.

    :raises TransferError: naming ``call`` and ``field`` if ``ptr`` is not a positive int or
        ``nbytes`` not a positive int (bools are rejected).
    """
    address = whole(f"{call}: {field}", ptr, least=1, error=TransferError)
    return address, whole(f"{call}: nbytes", nbytes, least=1, error=TransferError)


@final
class RegionTable:
    """Registered ranges of one engine, keyed by start address; no two overlap.

    Not thread-safe: the owning engine guards it with its lock.
    """

    __slots__ = ("_sizes", "_starts")

    def __init__(self) -> None:
        # Invariant: _starts is sorted, holds exactly the keys of _sizes, and the ranges
        # [start, start + size) are pairwise disjoint.
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def overlapping(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """The registered ``(start, nbytes)`` that overlaps ``[ptr, ptr + nbytes)``, if any."""
        i = bisect_right(self._starts, ptr)
        if i > 0:
            start = self._starts[i - 1]
            if start + self._sizes[start] > ptr:
                return start, self._sizes[start]
        if i < len(self._starts):
            start = self._starts[i]
            if start < ptr + nbytes:
                return start, self._sizes[start]
        return None

    def refuse_overlap(self, call: str, ptr: int, nbytes: int, where: str = "") -> None:
        """:raises TransferError: ``[ptr, ptr + nbytes)`` overlaps a registered range."""
        clash = self.overlapping(ptr, nbytes)
        if clash is not None:
            raise TransferError(
                f"{call} of {ptr:#x} ({nbytes} bytes){where}: overlaps the registered region "
                f"{clash[0]:#x} ({clash[1]} bytes)"
            )

    def refuse_unknown(self, call: str, ptr: object, where: str = "") -> None:
        """:raises TransferError: no registered range starts at ``ptr``."""
        if type(ptr) is not int or ptr not in self._sizes:
            raise TransferError(f"{call} of {ptr!r}{where}: not registered")

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside one registered range."""
        i = bisect_right(self._starts, ptr)
        if i == 0:
            return False
        start = self._starts[i - 1]
        return ptr + nbytes <= start + self._sizes[start]

    def add(self, ptr: int, nbytes: int) -> None:
        """Record a range; the caller checked :meth:`overlapping` first."""
        insort(self._starts, ptr)
        self._sizes[ptr] = nbytes

    def remove(self, ptr: int) -> int:
        """Forget the range starting at ``ptr`` and return its length (``KeyError`` if none)."""
        nbytes = self._sizes.pop(ptr)
        del self._starts[bisect_right(self._starts, ptr) - 1]
        return nbytes

    def items(self) -> list[tuple[int, int]]:
        """``(start, nbytes)`` of every range, by address."""
        return [(start, self._sizes[start]) for start in self._starts]

    def clear(self) -> None:
        self._starts.clear()
        self._sizes.clear()
