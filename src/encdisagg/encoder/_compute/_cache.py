"""The local prefix (embedding) cache: LRU by bytes, validated on the way in and out."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["CacheStats", "PrefixCache", "embedding_is_valid"]

#: The layout of a per-item entry: its token count and its grid row.
ItemLayout = tuple[int, tuple[int, ...]]


def embedding_is_valid(
    tensor: torch.Tensor, *, tokens: int, hidden_size: int, dtype: torch.dtype
) -> bool:
    """Whether ``tensor`` is a ``[tokens, hidden_size]`` embedding of ``dtype``."""
    return (
        tensor.dim() == 2
        and tensor.shape[0] == tokens
        and tensor.shape[1] == hidden_size
        and tensor.dtype == dtype
    )


@dataclass(frozen=True, slots=True)
class CacheStats:
    entries: int
    nbytes: int
    hits: int
    misses: int
    evictions: int
    invalid_evictions: int


class PrefixCache:
    """Embeddings keyed by ``Preprocessed.cache_key``, bounded by total bytes.

    Synchronous and never awaits: the Encoder calls it from its event loop thread only.
    Entries are read-only once inserted; callers that stage a hit must copy it, so the
    cache never shares memory with a registered region.

    Entries are either whole requests (keyed by ``Preprocessed.cache_key``) or, with the
    global cache on, single items (keyed per item, with their layout: see
    :meth:`lookup_item`).
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        # Layouts of per-item entries; a key is here only while it is in `_entries`.
        self._layouts: dict[str, ItemLayout] = {}
        self._nbytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._invalid_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> CacheStats:
        return CacheStats(
            entries=len(self._entries),
            nbytes=self._nbytes,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            invalid_evictions=self._invalid_evictions,
        )

    def lookup(
        self, key: str, *, tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The cached embedding for ``key``, or ``None`` on a miss.

        :raises ValueError: if the entry does not have the expected shape and dtype; the
            entry is evicted first, so the next lookup misses.
        """
        entry = self._entries.get(key)
        if entry is None:
            self._misses += 1
            return None
        if not embedding_is_valid(entry, tokens=tokens, hidden_size=hidden_size, dtype=dtype):
            self._remove(key)
            self._invalid_evictions += 1
            raise ValueError(
                f"cached embedding for {key[:16]} has shape {tuple(entry.shape)} and dtype "
                f"{entry.dtype}, expected ({tokens}, {hidden_size}) {dtype}; evicted"
            )
        self._entries.move_to_end(key)
        self._hits += 1
        return entry

    def lookup_item(
        self, key: str, *, hidden_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, ItemLayout] | None:
        """The cached embedding of one item and its layout (token count, grid row), or
        ``None`` on a miss (also for a whole-request entry under ``key``).

        :raises ValueError: if the entry does not match its layout, width and dtype; the
            entry is evicted first, so the next lookup misses.
        """
        layout = self._layouts.get(key)
        if layout is None:
            self._misses += 1
            return None
        entry = self.lookup(key, tokens=layout[0], hidden_size=hidden_size, dtype=dtype)
        return None if entry is None else (entry, layout)

    def insert(
        self,
        key: str,
        tensor: torch.Tensor,
        *,
        tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        grid: tuple[int, ...] | None = None,
    ) -> bool:
        """Insert a validated embedding; returns False if it is invalid or too large.

        With ``grid``, the entry is one item's (found by :meth:`lookup_item`).
        """
        if not embedding_is_valid(tensor, tokens=tokens, hidden_size=hidden_size, dtype=dtype):
            return False
        size = tensor.numel() * tensor.element_size()
        if size > self.capacity_bytes:
            return False
        if key in self._entries:
            self._remove(key)
        while self._entries and self._nbytes + size > self.capacity_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            self._evictions += 1
        self._entries[key] = tensor
        self._nbytes += size
        if grid is not None:
            self._layouts[key] = (tokens, grid)
        return True

    def _remove(self, key: str) -> None:
        tensor = self._entries.pop(key)
        self._layouts.pop(key, None)
        self._nbytes -= tensor.numel() * tensor.element_size()

    def clear(self) -> None:
        self._entries.clear()
        self._layouts.clear()
        self._nbytes = 0
