"""The cache never fails a request: a master killed mid-run leaves every request answered."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch

from encdisagg import Encoder, EncoderConfig, EncodeRequest
from encdisagg.encoder import EncoderEvents, ZmqDestination
from encdisagg.models import QwenVisionModel
from encdisagg.transfer import ZmqReceiver

from ._cluster import run_cluster
from .fakes import CountingModel

pytestmark = pytest.mark.anyio


async def encode_and_receive(encoder: Encoder, request: EncodeRequest) -> torch.Tensor:
    async with ZmqReceiver() as receiver:
        await encoder.encode(request)
        await encoder.send(request.req_id, ZmqDestination(receiver.url))
        with anyio.fail_after(30):
            part = await receiver.receive()
    assert part.tensor is not None
    return part.tensor


async def test_killing_the_master_mid_run_recomputes_and_opens_the_breaker(
    tmp_path: Path, tiny: QwenVisionModel, image: Callable[..., bytes]
) -> None:
    breaker: list[str] = []
    counting = CountingModel(tiny)
    items: list[object] = [image(1), image(2)]
    with run_cluster(tmp_path) as cluster:
        config = EncoderConfig(
            global_cache=cluster.url(timeout_ms=500, failures=2, cooldown_s=3600)
        )
        events = EncoderEvents(on_breaker=breaker.append)
        async with Encoder(config, model=counting, events=events) as encoder:
            cache = encoder.global_cache
            assert cache is not None
            assert cache.connected
            before = await encode_and_receive(encoder, EncodeRequest("before", items))
            await cache.drain()
            assert cache.stats().inserts == 2

            cluster.kill_master()
            for n in range(4):
                started = anyio.current_time()
                rows = await encode_and_receive(encoder, EncodeRequest(f"after-{n}", items))
                # A dead master's calls can take seconds to fail; requests wait timeout_ms.
                assert anyio.current_time() - started < 3
                assert torch.equal(rows, before)
            stats = cache.stats()
            # Every item was computed: first as fallbacks of failed lookups, then skipped
            # while the breaker is open.
            assert counting.forwarded == 2 + 4 * 2
            assert stats.fallbacks + stats.skipped == 4 * 2
            assert stats.lookup_failures >= 1
            assert stats.skipped >= 2
            assert stats.hits == 0
            assert stats.breaker == "open"
            assert breaker == ["open"]
            assert encoder.stats().live_requests == 0
