"""Prefill's KV staging: packing a request's KV into registered pages and writing it out.

A :class:`KVPageWriter` owns the staging pages and metadata rows that are registered with
prefill's engine. :meth:`~KVPageWriter.stage` takes pages and a row for a request (waiting,
bounded, for some to free up) and packs the KV into them in a worker thread;
:meth:`~KVPageWriter.write`, also run in a worker thread, writes every page into decode's
pages and then the row, its room tag last, so that decode never sees a row whose pages are
not all in. The caller frees the staging with :meth:`~KVPageWriter.unstage` once no write
reads it any more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from .._errors import BadRequestError, ServiceUnavailableError
from ..decode import KVPagePool, MetadataSlotAllocator, MetadataSlotTable
from ..nurseries import run_thread_to_completion
from ._pd_messages import ROPE_DELTA_WORD, SEQ_LEN_WORD

if TYPE_CHECKING:
    import threading

    from ..transfer import TransferEngine
    from ._lm import LanguageModel, PrefillResult
    from ._pd_messages import KVDestination
    from ._prefill_types import PipelineRequest

__all__ = ["KVPageWriter", "StagedKV"]


@dataclass(eq=False, slots=True)
class StagedKV:
    """The staging pages and row one request's KV is packed into."""

    pages: tuple[int, ...]
    row: int
    checksum: int = 0


class KVPageWriter:
    """Staging pages and rows, and the writes from them into decode's memory.

    :param page_bytes: KV page size; must equal the decode worker's.
    :param staging_timeout_s: bound on waiting for staging pages.
    """

    def __init__(
        self,
        lm: LanguageModel,
        engine: TransferEngine,
        *,
        page_bytes: int,
        staging_pages: int,
        staging_rows: int,
        staging_timeout_s: float,
    ) -> None:
        self.lm = lm
        self.engine = engine
        self.page_bytes = page_bytes
        self.staging = KVPagePool(staging_pages, page_bytes)
        self.page_tokens = page_bytes // lm.kv_bytes_per_token
        if self.page_tokens < 1 or self.page_tokens * lm.kv_bytes_per_token != page_bytes:
            raise BadRequestError(
                f"page_bytes {page_bytes} is not a whole number of tokens of KV "
                f"({lm.kv_bytes_per_token} bytes each)"
            )
        self.draft_layout = lm.draft_layout
        self.rows = MetadataSlotTable(staging_rows, extra_words=self.draft_layout.words)
        self.row_slots = MetadataSlotAllocator(staging_rows, zero_slot=self.rows.zero)
        self._staging_timeout_s = staging_timeout_s
        self._space = anyio.Event()

    async def stage(self, request: PipelineRequest, result: PrefillResult) -> StagedKV:
        """Take staging pages and a row, and pack the KV into them (worker thread).

        A checkpoint. If packing fails or is cancelled, the staging is given back.

        :raises BadRequestError: the KV does not fit all the staging pages.
        :raises ServiceUnavailableError: no pages or row freed up within the timeout.
        """
        count = max(1, -(-result.seq_len // self.page_tokens))  # pages hold whole tokens
        if count > self.staging.num_pages:
            raise BadRequestError(
                f"request {request.rid!r}: {count} KV pages do not fit the "
                f"{self.staging.num_pages} staging pages",
                req_id=request.rid,
            )
        try:
            with anyio.fail_after(self._staging_timeout_s):
                while True:
                    if self.staging.available() >= count and self.row_slots.available():
                        pages = self.staging.alloc(count)
                        row = self.row_slots.alloc()
                        assert pages is not None
                        assert row is not None
                        break
                    await self._space.wait()
        except TimeoutError:
            raise ServiceUnavailableError(
                f"request {request.rid!r}: no staging pages within {self._staging_timeout_s} s",
                req_id=request.rid,
            ) from None
        staged = StagedKV(tuple(pages), row)
        try:
            staged.checksum = await run_thread_to_completion(self._pack, request, result, staged)
        except BaseException:
            self.unstage(staged)
            raise
        return staged

    def _pack(self, request: PipelineRequest, result: PrefillResult, staged: StagedKV) -> int:
        blob = self.lm.pack_kv(result, self.page_tokens)
        size = self.page_bytes
        for index, page in enumerate(staged.pages):
            view = self.staging.page(page)
            view.zero_()
            chunk = blob[index * size : (index + 1) * size]
            view[: chunk.numel()] = chunk
        checksum = self.staging.checksum(staged.pages)
        if result.top_ids is not None and result.top_logprobs is not None:
            assert result.hidden is not None
            # The draft state travels in the row's body, so it is in before the room tag.
            self.draft_layout.write(
                self.rows.extra(staged.row), result.top_ids, result.top_logprobs, result.hidden
            )
        self.rows.write(
            staged.row,
            room=request.room,
            first_token_id=result.first_token,
            cached_tokens=0,
            checksum=checksum,
        )
        self.rows.rows[staged.row, ROPE_DELTA_WORD] = result.rope_delta
        self.rows.rows[staged.row, SEQ_LEN_WORD] = result.seq_len
        return checksum

    def unstage(self, staged: StagedKV) -> None:
        """Give the staging back (once); wakes requests waiting for pages."""
        pages, staged.pages = staged.pages, ()
        if pages:
            self.staging.free(pages)
        if staged.row >= 0:
            row, staged.row = staged.row, -1
            self.row_slots.free(row)
        self._space.set()
        self._space = anyio.Event()

    def check_destination(self, destination: KVDestination, staged: StagedKV) -> None:
        """:raises BadRequestError: decode's pages or row do not fit what is staged."""
        rid = destination.rid
        if destination.page_bytes != self.page_bytes:
            raise BadRequestError(
                f"request {rid!r}: decode's pages are {destination.page_bytes} bytes, "
                f"prefill's {self.page_bytes}",
                req_id=rid,
            )
        if len(destination.page_addresses) != len(staged.pages):
            raise BadRequestError(
                f"request {rid!r}: decode gave {len(destination.page_addresses)} pages for "
                f"{len(staged.pages)} pages of KV",
                req_id=rid,
            )
        if destination.row_bytes != self.rows.row_bytes:
            raise BadRequestError(f"request {rid!r}: metadata rows differ in size", req_id=rid)

    def write(
        self, staged: StagedKV, destination: KVDestination | None, stop: threading.Event
    ) -> bool:
        """Write the pages, then the metadata row (its room tag last). Worker thread.

        Returns False if ``stop`` was set (decode's abort; checked between writes).
        """
        assert destination is not None
        engine = self.engine
        session = destination.session_id
        for page, address in zip(staged.pages, destination.page_addresses, strict=True):
            if stop.is_set():
                return False
            engine.write(session, self.staging.page_address(page), address, self.page_bytes)
        if stop.is_set():
            return False
        row = self.rows.row_address(staged.row)
        tag = 8  # the room word leads the row
        engine.write(session, row + tag, destination.row_address + tag, self.rows.row_bytes - tag)
        engine.write(session, row, destination.row_address, tag)
        return True
