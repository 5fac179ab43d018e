"""A Mooncake write whose outcome is unknown: its landing pages stay held until the encoder
says it ended, and no other request's embedding is ever written into them.

Real parts: a real Encoder behind the real HTTP app, a real EmbeddingReceiver and
fetch_embeddings, two Loopback engines on one fabric. Only the encoder's engine is wrapped,
so that a write times out and lands when the test says.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from encdisagg import Modality
from encdisagg.models import QwenVisionModel
from encdisagg.receiver import (
    EmbeddingReceiver,
    EncoderCallError,
    EncoderClient,
    PageRun,
    fetch_embeddings,
)
from encdisagg.transfer import LoopbackEngine, LoopbackFabric

from ._late_writes import LateWriteEngine, ended_on_exit
from .conftest import data_url, encoder_server

pytestmark = pytest.mark.anyio

#: A 56 x 56 image is 4 tokens of 64 float32 on the tiny model: 1024 bytes, two pages.
PAGE_BYTES = 512
PART_BYTES = 1024


def reference(model: QwenVisionModel, image: str) -> torch.Tensor:
    return torch.cat(model.forward([model.preprocess([image], Modality.IMAGE)]))


def overlaps(tensor: torch.Tensor, receiver: EmbeddingReceiver, run: PageRun) -> bool:
    pool = receiver.pool
    start = pool.address(run)
    end = start + run.count * pool.page_bytes
    first = tensor.data_ptr()
    return first < end and start < first + tensor.numel() * tensor.element_size()


async def test_a_write_that_may_still_land_holds_its_pages_until_the_encoder_says_it_ended(
    tiny: QwenVisionModel,
) -> None:
    image_a, image_b = data_url(56, 56, 1), data_url(56, 56, 2)
    fabric = LoopbackFabric()
    # Named as a Mooncake session is ("host:port"): /send checks the port it is given.
    receiver_engine = LoopbackEngine(fabric, name="127.0.0.1:17001")
    async with receiver_engine, LoopbackEngine(fabric) as loopback:
        engine = LateWriteEngine(loopback)
        receiver = EmbeddingReceiver(
            transport="mooncake",
            hidden_size=tiny.hidden_size,
            dtype=tiny.dtype,
            engine=receiver_engine,
            # Two parts' worth: first fit would hand a's pages to b if they were free.
            landing_pages=4,
            page_bytes=PAGE_BYTES,
        )
        async with (
            encoder_server(tiny, transfer="mooncake", engine=engine) as (url, _, faults),
            EncoderClient([url]) as client,
            receiver,
        ):
            with ended_on_exit(engine):
                with pytest.raises(EncoderCallError) as caught:
                    async with fetch_embeddings(client, receiver, "a", {"image": [image_a]}):
                        pytest.fail("no embeddings expected")
                error = caught.value
                assert (error.route, error.status, error.part_idx, error.req_id) == (
                    "/send",
                    504,
                    0,
                    "a",
                )
                # The write may still land: its pages are held, not free, not in use.
                assert receiver.pool.held_runs() == (PageRun(0, 2),)
                stats = receiver.stats()
                assert (stats.held_pages, stats.quarantined_pages, stats.retired_pages) == (2, 2, 0)
                assert (stats.held_bytes, stats.landing_pages_in_use) == (PART_BYTES, 0)
                # The encoder itself says so for as long as the write may land.
                part_a = client.plan("a", {"image": [image_a]}).parts[0]
                assert (await client.release_outcome([part_a])).held == {"a#0"}

                async with fetch_embeddings(client, receiver, "b", {"image": [image_b]}) as got:
                    joined = got.of("image")
                    assert joined is not None
                    b = joined.tensor
                    assert not overlaps(b, receiver, PageRun(0, 2))
                    before = b.clone()
                    engine.land()
                    # The late write landed in a's held pages only: b is byte for byte intact.
                    assert torch.equal(b, before)
                    torch.testing.assert_close(b, reference(tiny, image_b))
                    landed = receiver.pool.view(PageRun(0, 2), PART_BYTES)
                    torch.testing.assert_close(
                        landed.view(tiny.dtype).view(4, tiny.hidden_size),
                        reference(tiny, image_a),
                    )

                # The encoder now answers the release: the receiver's next ask frees the pages.
                with anyio.fail_after(20):
                    while receiver.stats().held_pages:
                        await anyio.sleep(0.05)
                stats = receiver.stats()
                assert (stats.held_pages, stats.held_bytes, stats.landing_pages_in_use) == (0, 0, 0)
                assert receiver.pool.available() == 4
                # The fetch's release, the test's, then the receiver's own asks (one at least).
                assert faults.calls.count(("/release", "a#0")) >= 3
        assert receiver_engine.registered_regions() == 0
