"""KV page allocation, free of torch: which page indices belong to whom."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from .._errors import InternalError
from .._numbers import whole

__all__ = ["PageAllocator", "PageSource"]


@runtime_checkable
class PageSource(Protocol):
    """Where decode KV pages come from. All calls are synchronous."""

    @property
    def num_pages(self) -> int:
        """How many pages there are in all."""
        ...

    def available(self) -> int:
        """How many pages can be allocated right now."""
        ...

    def alloc(self, count: int) -> tuple[int, ...] | None:
        """Take ``count`` pages, or ``None`` (taking none) if fewer are free."""
        ...

    def free(self, pages: Iterable[int]) -> None:
        """Give ``pages`` back. Raises :class:`~encdisagg.InternalError` on a double free."""
        ...


class PageAllocator:
    """Page indices ``0 .. num_pages-1``, handed out and taken back with double-free checks.

    Like metadata slots, freed pages are reused oldest-freed first. Every method is
    synchronous.
    """

    __slots__ = ("_free", "_is_free", "_num_pages")

    def __init__(self, num_pages: int) -> None:
        whole("num_pages", num_pages)
        self._num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = bytearray(b"\x01" * num_pages)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def available(self) -> int:
        return len(self._free)

    def _check(self, page: int) -> None:
        if not 0 <= page < self._num_pages:
            raise InternalError(f"KV page {page} is out of range [0, {self._num_pages})")

    def is_allocated(self, page: int) -> bool:
        """Whether ``page`` is a valid page that is handed out right now."""
        return 0 <= page < self._num_pages and not self._is_free[page]

    def alloc(self, count: int) -> tuple[int, ...] | None:
        """Take ``count`` pages, or ``None`` (taking none) if fewer are free."""
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        if count > len(self._free):
            return None
        pages = tuple(self._free.popleft() for _ in range(count))
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Give ``pages`` back, all or none.

        :raises InternalError: if a page is out of range, not allocated, or listed twice;
            then no page is freed.
        """
        pages = tuple(pages)
        seen: set[int] = set()
        for page in pages:
            self._check(page)
            if self._is_free[page] or page in seen:
                raise InternalError(f"KV page {page} freed twice")
            seen.add(page)
        for page in pages:
            self._is_free[page] = 1
            self._free.append(page)
