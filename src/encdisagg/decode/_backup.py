"""Retraction's KV backups: a request's pages copied off the pool, and back."""

from __future__ import annotations

import torch

from .._errors import InternalError
from ._pool import KVPagePool

__all__ = ["PagedKVBackup"]


class PagedKVBackup:
    """A :class:`KVBackup` over a :class:`KVPagePool`: whole pages, copied in host memory.

    Both calls are synchronous memory copies; the scheduler makes them between steps, when
    no forward touches the pages.
    """

    def __init__(self, pool: KVPagePool) -> None:
        self.pool = pool
        #: Bytes held by backups taken and not yet restored (a retraction's cost in memory).
        self.bytes_held = 0

    def backup(self, pages: tuple[int, ...], kv_len: int) -> object:
        del kv_len  # whole pages are copied: a page is the unit the pool hands out
        if not pages:
            return torch.empty((0, 0), dtype=self.pool.buffer.dtype)
        index = torch.tensor(pages, dtype=torch.long)
        copy = self.pool.buffer.view(self.pool.num_pages, -1).index_select(0, index)
        self.bytes_held += copy.numel() * copy.element_size()
        return copy

    def restore(self, backup: object, pages: tuple[int, ...]) -> None:
        if not isinstance(backup, torch.Tensor) or backup.shape[0] > len(pages):
            raise InternalError(f"a KV backup does not fit {len(pages)} pages")
        count = int(backup.shape[0])
        if count:
            index = torch.tensor(pages[:count], dtype=torch.long)
            self.pool.buffer.view(self.pool.num_pages, -1).index_copy_(0, index, backup)
        self.bytes_held -= backup.numel() * backup.element_size()
