"""Decode KV memory: pages in one flat buffer, and the metadata slot table.

Both live in torch CPU (or pinned/device) tensors whose address never changes, so each can be
registered with a :class:`~encdisagg.transfer.TransferEngine` once and written into by the
prefill side for as long as it stays registered.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Self

import anyio.lowlevel
import torch

from .._errors import InternalError, TransferError
from .._numbers import real, whole
from ..transfer import Hold, MemoryRegistration, MemoryRegistrationState
from ._pages import PageAllocator
from ._request import DecodeRequest
from ._slots import MetadataRow
from ._transfer import CommitStatus, KVSink

if TYPE_CHECKING:
    from ..transfer import TransferEngine

__all__ = ["KVPagePool", "MetadataSlotTable", "PagedKVSink", "kv_checksum"]

_log = logging.getLogger("encdisagg.decode")


#: How long leaving a ``registered`` block tries to deregister by default; past it the
#: registration is left to the engine.
CLOSE_TIMEOUT_S = 10.0


async def _close(
    registration: MemoryRegistration, timeout_s: float, failed: BaseException | None
) -> None:
    """Deregister, shielded and bounded; a held buffer is left to the engine at once, since
    whoever could have settled its holds is gone with the block. A deregistration that kept
    failing (left to the engine too, by ``close``) is raised as a :class:`TransferError`, or
    noted on ``failed``, the error the block raised."""
    if registration.state is not MemoryRegistrationState.REGISTERED:
        # Never registered (the engine refused), or left to the engine inside the block.
        await anyio.lowlevel.cancel_shielded_checkpoint()
        return
    if registration.held:
        registration.leave("a write may still land in it: it is held")
        await anyio.lowlevel.cancel_shielded_checkpoint()
        return
    if await registration.close(timeout_s=timeout_s):
        return
    message = (
        f"deregistering {registration.what} failed (the engine's error is logged); "
        "it is left registered with its engine"
    )
    if failed is None:
        raise TransferError(message)
    failed.add_note(message)


class _RegisteredBuffer:
    """A buffer the prefill side writes into once it is registered with an engine, at most
    one registration at a time (a :class:`~encdisagg.transfer.MemoryRegistration` per
    ``registered`` block): what :class:`KVPagePool` and :class:`MetadataSlotTable` share."""

    def __init__(self, what: str, buffer: torch.Tensor) -> None:
        self._what = what
        self._buffer = buffer
        self._registration: MemoryRegistration | None = None

    @property
    def ptr(self) -> int:
        """The address of the buffer (page 0, row 0)."""
        return int(self._buffer.data_ptr())

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    @property
    def registered_with(self) -> TransferEngine | None:
        """The engine the buffer is registered with by a ``registered`` block, if any."""
        registration = self._registration
        if registration is None or not registration.registered:
            return None
        return registration.engine

    @property
    def registration(self) -> MemoryRegistration | None:
        """The buffer's registration while a ``registered`` block runs."""
        return self._registration

    def hold(self, hold: Hold) -> None:
        """A prefill write may still land in some pages (or rows) until ``hold`` settles:
        while the buffer is registered, it is not deregistered before that, and ``hold``
        keeps it alive; held memory is never deregistered or freed under a late write. Not a
        checkpoint; thread-safe."""
        registration = self._registration
        if registration is not None:
            registration.hold(hold)

    @asynccontextmanager
    async def registered(
        self, engine: TransferEngine, *, close_timeout_s: float = CLOSE_TIMEOUT_S
    ) -> AsyncIterator[Self]:
        """Register the whole buffer with ``engine`` for the duration of the block.

        Registering is a checkpoint (in a worker thread for a blocking engine); a caller
        cancelled meanwhile returns once the engine call is over, and the registration it
        made is deregistered. Leaving the block is shielded and a checkpoint:

        - a buffer no hold is on (:meth:`hold`) is deregistered, a failed attempt retried
          for ``close_timeout_s`` at most (10 s by default); past that bound it is left to
          the engine and :class:`~encdisagg.TransferError` is raised (the engine's error is
          logged), or attached as a note to the error the block raised;
        - a buffer still held is not waited for (settle the holds that may still settle
          before leaving the block) but left to the engine at once.

        Memory left to the engine stays registered and alive until the engine closes (for
        an engine that cannot say when, for the life of the process), and is logged: it is
        never deregistered or freed under a write that may still land.

        :raises InternalError: if the buffer is registered already.
        :raises ValueError: for a negative ``close_timeout_s``.
        """
        real("close_timeout_s", close_timeout_s, least=0, finite=False)
        if self._registration is not None:
            raise InternalError(f"{self._what} is registered already")
        registration = MemoryRegistration(
            engine, self.ptr, self.nbytes, self._buffer, what=self._what
        )
        self._registration = registration
        failed: BaseException | None = None
        try:
            # A caller cancelled while the engine registers returns once the engine did,
            # the registration it made recorded: the finally below undoes it.
            await registration.open()
            yield self
        except BaseException as exc:
            failed = exc
            raise
        finally:
            self._registration = None
            await _close(registration, close_timeout_s, failed)


def kv_checksum(chunks: Iterable[torch.Tensor]) -> int:
    """A checksum of the bytes of ``chunks``, in order; never ``0`` (which means "none")."""
    crc = 0
    for chunk in chunks:
        data = chunk.detach().cpu().contiguous().view(torch.uint8).numpy()
        crc = zlib.crc32(data.data, crc)
    return crc + 1


class KVPagePool(_RegisteredBuffer, PageAllocator):
    """Fixed-size KV pages carved out of one flat tensor.

    :param num_pages: how many pages.
    :param page_bytes: the size of one page in bytes (a multiple of ``dtype``'s item size).
    :param dtype: the element type of the buffer.
    :param device: where the buffer lives.

    Allocation and freeing are :class:`PageAllocator`'s (synchronous); a double free raises
    :class:`~encdisagg.InternalError`. Register the buffer with an engine for the pool's
    working life with ``async with pool.registered(engine): ...``, and keep every request that
    uses the pages inside that block, so the pages are deregistered only after their last
    writer is gone.
    """

    def __init__(
        self,
        num_pages: int,
        page_bytes: int,
        *,
        dtype: torch.dtype = torch.uint8,
        device: torch.device | str = "cpu",
    ) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if page_bytes <= 0 or page_bytes % itemsize:
            raise ValueError(
                f"page_bytes must be a positive multiple of {itemsize} for {dtype}, "
                f"got {page_bytes}"
            )
        PageAllocator.__init__(self, num_pages)
        self.page_bytes = page_bytes
        self._page_elems = page_bytes // itemsize
        self.buffer = torch.zeros(num_pages * self._page_elems, dtype=dtype, device=device)
        _RegisteredBuffer.__init__(
            self, f"KV page pool ({num_pages} x {page_bytes} B)", self.buffer
        )

    # -- addresses and views -------------------------------------------------------------------

    def page_address(self, page: int) -> int:
        """The address of ``page``, for a remote writer."""
        self._check(page)
        return self.ptr + page * self.page_bytes

    def page(self, page: int) -> torch.Tensor:
        """A view of ``page``'s elements (writes go to the pool)."""
        self._check(page)
        start = page * self._page_elems
        return self.buffer[start : start + self._page_elems]

    def checksum(self, pages: Iterable[int]) -> int:
        """:func:`kv_checksum` of ``pages``, in the order given."""
        return kv_checksum(self.page(page) for page in pages)


#: Column of each field in a metadata row. Rows are 8 int64 words (64 bytes, one cache line,
#: the granularity RDMA writes land with); the last words are spare.
_ROOM, _FIRST_TOKEN, _CACHED_TOKENS, _CHECKSUM = 0, 1, 2, 3
_ROW_WORDS = 8


class MetadataSlotTable(_RegisteredBuffer):
    """The metadata rows the prefill side writes, one per metadata slot.

    Each row carries the writer's room tag, the first output token, how many prompt tokens
    were cached, and a checksum of the KV pages; ``extra_words`` more words per row carry
    whatever the writer ships beside them (see :class:`DraftLayout`), written before the tag.
    Hand :meth:`zero` to :class:`MetadataSlotAllocator` as its ``zero_slot`` so a row is
    cleared before its slot can be reused.
    """

    def __init__(
        self, size: int, *, extra_words: int = 0, device: torch.device | str = "cpu"
    ) -> None:
        whole("size", size)
        whole("extra_words", extra_words)
        self.size = size
        self.extra_words = extra_words
        self.rows = torch.zeros((size, _ROW_WORDS + extra_words), dtype=torch.int64, device=device)
        super().__init__(f"metadata slot table ({size} rows)", self.rows)

    @property
    def row_bytes(self) -> int:
        return (_ROW_WORDS + self.extra_words) * 8

    def extra(self, slot: int) -> torch.Tensor:
        """A view of ``slot``'s words past the fixed eight (e.g. a draft state), in place."""
        self._check(slot)
        return self.rows[slot, _ROW_WORDS:]

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.size:
            raise InternalError(f"metadata slot {slot} is out of range [0, {self.size})")

    def row_address(self, slot: int) -> int:
        """The address of ``slot``'s row, for a remote writer."""
        self._check(slot)
        return self.ptr + slot * self.row_bytes

    def write(
        self,
        slot: int,
        *,
        room: int,
        first_token_id: int,
        cached_tokens: int = 0,
        checksum: int = 0,
    ) -> None:
        """Write a row the way the prefill side does (for local writers and tests)."""
        self._check(slot)
        row = self.rows[slot]
        row[_FIRST_TOKEN] = first_token_id
        row[_CACHED_TOKENS] = cached_tokens
        row[_CHECKSUM] = checksum
        # The tag goes last: a reader that sees it sees a complete row.
        row[_ROOM] = room

    def read(self, slot: int) -> MetadataRow:
        self._check(slot)
        room, first_token, cached, checksum = self.rows[slot, :4].tolist()
        return MetadataRow(
            room=room, first_token_id=first_token, cached_tokens=cached, checksum=checksum
        )

    def zero(self, slot: int) -> None:
        """Clear ``slot``'s row, its room tag above all."""
        self._check(slot)
        self.rows[slot].zero_()

    def is_zero(self, slot: int) -> bool:
        self._check(slot)
        return not bool(self.rows[slot].any())


class PagedKVSink(KVSink):
    """A :class:`KVSink` over a :class:`KVPagePool` and a :class:`MetadataSlotTable`.

    - ``commit`` reads the request's metadata row: an empty tag is ``NOT_READY``; a tag
      naming another room, or a checksum that does not match the pages, is ``CORRUPT``;
      otherwise the row is stored in ``req.metadata`` and the request is ``COMMITTED``.
    - ``release`` frees the request's pages and empties ``req.pages``, so the same pages are
      never freed twice through this request.
    - ``abort`` calls ``on_abort`` (or logs).
    - ``hold`` (a held request: a late write may still land) puts the hold on both the
      pool's and the table's registration, so neither is deregistered before it settles.

    Rooms must be non-zero: ``0`` is the "not landed" tag.
    """

    def __init__(
        self,
        pool: KVPagePool,
        table: MetadataSlotTable,
        *,
        on_abort: Callable[[DecodeRequest, str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.table = table
        self._on_abort = on_abort

    def commit(self, req: DecodeRequest) -> CommitStatus:
        if req.metadata_slot is None or req.metadata_slot < 0:
            raise InternalError(f"request {req.rid!r} holds no metadata slot", req_id=req.rid)
        row = self.table.read(req.metadata_slot)
        if row.room == 0:
            return CommitStatus.NOT_READY
        if row.room != req.room:
            return CommitStatus.CORRUPT
        if row.checksum and row.checksum != self.pool.checksum(req.pages):
            return CommitStatus.CORRUPT
        req.metadata = row
        return CommitStatus.COMMITTED

    def release(self, req: DecodeRequest) -> None:
        pages, req.pages = req.pages, ()
        self.pool.free(pages)

    def hold(self, req: DecodeRequest, hold: Hold) -> None:
        self.pool.hold(hold)
        self.table.hold(hold)

    def abort(self, req: DecodeRequest, message: str) -> None:
        if self._on_abort is not None:
            self._on_abort(req, message)
        else:
            _log.info("request %r aborted: %s", req.rid, message)
