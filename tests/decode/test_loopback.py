"""Prefill writes KV and metadata into the decode side's registered memory (LoopbackEngine)."""

from __future__ import annotations

import pytest
import torch

from encdisagg import TransferError, transfer
from encdisagg.decode import (
    AbortAckTracker,
    DecodePreallocQueue,
    DecodeTransferQueue,
    KVPagePool,
    KVPoll,
    MetadataSlotAllocator,
    MetadataSlotTable,
    PagedKVSink,
    PreallocRequest,
)

from ._fakes import FakeClock

pytestmark = pytest.mark.anyio

PAGE_BYTES = 256


async def test_kv_written_over_the_engine_is_committed_and_checked() -> None:
    fabric = transfer.LoopbackFabric()
    async with (
        transfer.LoopbackEngine(fabric, name="prefill") as prefill,
        transfer.LoopbackEngine(fabric, name="decode") as decode,
    ):
        pool = KVPagePool(8, PAGE_BYTES)
        table = MetadataSlotTable(4)
        slots = MetadataSlotAllocator(4, zero_slot=table.zero)
        queue = DecodeTransferQueue(
            kv=PagedKVSink(pool, table), slots=slots, acks=AbortAckTracker(), clock=FakeClock()
        )
        prealloc = DecodePreallocQueue(pages=pool, slots=slots)
        # The prefill side's own registered memory: the KV it computed and a metadata row.
        source = KVPagePool(3, PAGE_BYTES)
        source.buffer.copy_(torch.arange(source.buffer.numel(), dtype=torch.int64) % 251)
        source_rows = MetadataSlotTable(1)

        async with source.registered(prefill), source_rows.registered(prefill):
            async with pool.registered(decode), table.registered(decode):
                prealloc.add(PreallocRequest("r", 7, num_pages=3))
                (req,) = prealloc.pop_preallocated({"r": KVPoll.WaitingForInput}).preallocated
                assert req.metadata_slot is not None
                queue.add(req)

                # The KV pages land first; without the tagged metadata row nothing is committed.
                for index, page in enumerate(req.pages):
                    prefill.write(
                        "decode", source.page_address(index), pool.page_address(page), PAGE_BYTES
                    )
                assert queue.pop_transferred({"r": KVPoll.Success}) == []
                source_rows.write(
                    0,
                    room=7,
                    first_token_id=42,
                    cached_tokens=3,
                    checksum=source.checksum(range(3)),
                )
                prefill.write(
                    "decode",
                    source_rows.row_address(0),
                    table.row_address(req.metadata_slot),
                    table.row_bytes,
                )
                slot = req.metadata_slot
                assert queue.pop_transferred({"r": KVPoll.Success}) == [req]
                assert req.metadata is not None
                assert req.metadata.first_token_id == 42
                assert table.is_zero(slot)
            assert decode.registered_regions() == 0
            # Deregistered: a straggling write is refused instead of landing in freed memory.
            with pytest.raises(TransferError, match="remote range"):
                prefill.write("decode", source.page_address(0), pool.page_address(0), PAGE_BYTES)
