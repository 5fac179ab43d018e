"""Fixtures of the pipeline tests: engines wrapped to pause or corrupt writes, workers wired
together over real Loopback engines."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest
import torch

from encdisagg.pipeline import DecodeWorker, LanguageModel, PrefillWorker
from encdisagg.pipeline._pd_messages import DecodeMessage, PrefillMessage
from encdisagg.receiver import EmbeddingReceiver, EncoderClient
from encdisagg.transfer import HoldPolicy, LoopbackEngine, LoopbackFabric, TransferEngine


class GatedEngine:
    """A real engine whose writes can be held at a gate, or corrupted after they land."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        #: Set when a write reached the gate.
        self.waiting = threading.Event()
        #: Flip one byte of the next write of this many bytes, after it landed.
        self.corrupt_size: int | None = None
        self.writes = 0

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, ptr: int, nbytes: int) -> None:
        self.inner.register(ptr, nbytes)

    def deregister(self, ptr: int) -> None:
        self.inner.deregister(ptr)

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        self.waiting.set()
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        self.inner.write(target_session, local_ptr, remote_ptr, nbytes)
        self.writes += 1
        if self.corrupt_size == nbytes:
            self.corrupt_size = None
            byte = ctypes.c_uint8.from_address(remote_ptr)
            byte.value ^= 0xFF


@dataclass
class Wiring:
    prefill: PrefillWorker
    decode: DecodeWorker
    engine: GatedEngine
    reference: LanguageModel
    #: Messages to decode pass through this filter (return False to drop one).
    to_decode: Callable[[DecodeMessage], bool]
    to_prefill: Callable[[PrefillMessage], bool]
    #: The engine decode's pages and rows are registered with.
    decode_engine: LoopbackEngine


@pytest.fixture(scope="session")
def reference_lm() -> LanguageModel:
    return LanguageModel.tiny()


@asynccontextmanager
async def wired(
    reference: LanguageModel,
    *,
    encoder_urls: tuple[str, ...] = ("http://127.0.0.1:1",),
    release_timeout_s: float = 30.0,
    on_release_timeout: HoldPolicy = HoldPolicy.RETIRE,
    fetch_timeout_s: float = 30.0,
    num_pages: int = 64,
) -> AsyncIterator[Wiring]:
    fabric = LoopbackFabric()
    async with (
        LoopbackEngine(fabric, name="prefill") as prefill_engine,
        LoopbackEngine(fabric, name="decode") as decode_engine,
    ):
        gated = GatedEngine(prefill_engine)
        lm_prefill = LanguageModel.tiny()
        lm_decode = LanguageModel.tiny()
        client = EncoderClient(list(encoder_urls), connect_timeout_s=2.0)
        receiver = EmbeddingReceiver(
            transport="zmq", hidden_size=lm_prefill.hidden_size, dtype=torch.float32
        )
        decode = DecodeWorker(
            lm_decode,
            engine=decode_engine,
            num_pages=num_pages,
            release_timeout_s=release_timeout_s,
            on_release_timeout=on_release_timeout,
        )
        prefill = PrefillWorker(
            lm_prefill,
            client=client,
            receiver=receiver,
            engine=gated,
            page_bytes=decode.page_bytes,
            staging_pages=64,
            fetch_timeout_s=fetch_timeout_s,
        )
        wiring = Wiring(
            prefill, decode, gated, reference, lambda m: True, lambda m: True, decode_engine
        )

        def to_decode(message: DecodeMessage) -> None:
            if wiring.to_decode(message):
                decode.deliver(message)

        def to_prefill(message: PrefillMessage) -> None:
            if wiring.to_prefill(message):
                prefill.deliver(message)

        prefill.connect(to_decode)
        decode.connect(to_prefill)
        async with client, receiver, decode, prefill:
            yield wiring
        # Every worker is closed: nothing may be left anywhere but retired pages, which a
        # late write may still reach: they stay registered (left to the engine) with their
        # metadata slot until the engine closes.
        stats = decode.stats()
        assert stats.leaked_pages == 0, stats
        assert stats.pages_free + stats.retired_pages == stats.pages_total, stats
        assert stats.slots_free + stats.retired == stats.slots_total, stats
        assert prefill.staging.available() == prefill.staging.num_pages
        assert prefill.row_slots.available() == prefill.rows.size
        assert decode_engine.registered_regions() == (2 if stats.retired else 0)
        assert prefill_engine.registered_regions() == 0


async def wait_for(event: threading.Event) -> None:
    """Wait for a thread-side event without blocking the loop."""
    assert await anyio.to_thread.run_sync(event.wait, 10.0)
