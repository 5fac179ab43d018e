"""Steady-state request lifecycles leave no garbage in reference cycles.

A cycle outlives its last reference until the cyclic collector runs; on a busy encoder
that is staged memory (a tensor, a region) held for a collection's worth of time, and
collector pauses that grow with the request rate. Each lifecycle here encodes, writes into
a registered buffer over the loopback engine, pushes over real ZMQ, and is released by its
second delivery; with the collector off, none of it may be left for the collector.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import pytest
import torch

from encdisagg import Encoder, EncodeRequest, MooncakeDestination, ZmqDestination
from encdisagg.models import NullVisionModel, VisionModel
from encdisagg.transfer import LoopbackEngine, LoopbackFabric, ZmqReceiver

from .fakes import ScriptedModel

pytestmark = pytest.mark.anyio

MakeEncoder = Callable[..., Encoder]

WARM_UP = 50
MEASURED = 200


@contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.enable()


def collect_cycles() -> tuple[int, list[tuple[str, int]]]:
    """Collect; how many objects were in cycles, and the commonest of their types."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        found = gc.collect()
        kinds = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found, kinds.most_common(15)


async def lifecycles(
    make_encoder: MakeEncoder, model: VisionModel, items: list[object], *, staging_arena_mb: int
) -> tuple[int, list[tuple[str, int]]]:
    """Run the warm-up, then the measured lifecycles with the collector off; what the
    collector then finds."""
    fabric = LoopbackFabric()
    async with (
        LoopbackEngine(fabric, name="encoder") as engine,
        LoopbackEngine(fabric, name="prefill") as prefill,
        ZmqReceiver() as receiver,
        make_encoder(model=model, engine=engine, staging_arena_mb=staging_arena_mb) as encoder,
    ):
        landing = torch.zeros(4096, dtype=torch.uint8)
        prefill.register(landing.data_ptr(), landing.numel())
        written = MooncakeDestination("prefill", landing.data_ptr(), "prefill:1")
        pushed = ZmqDestination(receiver.url)

        async def one(index: int) -> None:
            req_id = f"r{index}"
            result = await encoder.encode(EncodeRequest(req_id, items))
            await encoder.send(req_id, written, receive_count=2)
            await encoder.send(req_id, pushed, receive_count=2)
            with anyio.fail_after(30):
                part = await receiver.receive()
            assert part.header.req_id == req_id
            assert part.header.shape == (result.num_tokens, result.hidden_size)

        for index in range(WARM_UP):
            await one(index)
        with collector_off():
            for index in range(WARM_UP, WARM_UP + MEASURED):
                await one(index)
            found = collect_cycles()
        stats = encoder.stats()
        assert (stats.live_requests, stats.staged_bytes, stats.inflight_transfers) == (0, 0, 0)
        prefill.deregister(landing.data_ptr())
    return found


@pytest.mark.parametrize("staging_arena_mb", [1, 0], ids=["arena", "own-registration"])
async def test_non_blocking_lifecycles_leave_no_reference_cycles(
    make_encoder: MakeEncoder, staging_arena_mb: int
) -> None:
    model = NullVisionModel(hidden_size=4, tokens_per_item=2)
    found, kinds = await lifecycles(
        make_encoder, model, ["item"], staging_arena_mb=staging_arena_mb
    )
    assert found == 0, kinds


async def test_blocking_model_lifecycles_leave_no_reference_cycles(
    make_encoder: MakeEncoder,
) -> None:
    # Worker threads for preprocessing and the batcher's forward.
    found, kinds = await lifecycles(make_encoder, ScriptedModel(), [4], staging_arena_mb=1)
    assert found == 0, kinds
