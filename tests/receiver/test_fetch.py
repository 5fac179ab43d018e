"""fetch_embeddings end to end: real encoders over HTTP, real ZMQ and Mooncake transfers."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
import torch

from encdisagg import BadRequestError, Modality, RequestTimeoutError
from encdisagg.models import QwenVisionModel, load_model
from encdisagg.receiver import (
    EmbeddingReceiver,
    EncoderCallError,
    EncoderClient,
    fetch_embeddings,
)
from encdisagg.transfer import EmbeddingHeader, MooncakeEngine, ZmqPushPool, payload_view

from ._encoder_app import Faults
from .conftest import data_url, encoder_server

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tiny_b() -> QwenVisionModel:
    return load_model("tiny")


def reference(model: QwenVisionModel, images: list[str]) -> torch.Tensor:
    pre = model.preprocess(images, Modality.IMAGE)
    return torch.cat(model.forward([pre]))


async def test_zmq_parts_from_two_encoders_assemble_in_item_order(
    tiny: QwenVisionModel, tiny_b: QwenVisionModel
) -> None:
    images = [data_url(56, 56, 1), data_url(84, 56, 2), data_url(112, 84, 3)]
    receiver = EmbeddingReceiver(transport="zmq", hidden_size=tiny.hidden_size, dtype=tiny.dtype)
    async with (
        encoder_server(tiny) as (url_a, _, _),
        encoder_server(tiny_b) as (url_b, _, _),
        EncoderClient([url_a, url_b]) as client,
        receiver,
    ):
        async with fetch_embeddings(client, receiver, "r", {"image": images}) as embeddings:
            assert [p.part_idx for p in embeddings.parts] == [0, 1]
            joined = embeddings.of("image")
            assert joined is not None
            assert embeddings.of(Modality.VIDEO) is None
            expected = tiny.preprocess(images, Modality.IMAGE)
            assert joined.token_counts == expected.token_counts
            assert joined.grid == expected.grid
            torch.testing.assert_close(joined.tensor, reference(tiny, images))
            assert receiver.stats().live_requests == 1
        stats = receiver.stats()
        assert (stats.live_requests, stats.parts_received, stats.stale_parts_dropped) == (0, 2, 0)


async def test_mooncake_parts_land_in_the_registered_pool(
    tiny: QwenVisionModel, mooncake_engines: tuple[MooncakeEngine, MooncakeEngine]
) -> None:
    encoder_engine, receiver_engine = mooncake_engines
    images = [data_url(56, 56, 4), data_url(56, 84, 5)]
    receiver = EmbeddingReceiver(
        transport="mooncake",
        hidden_size=tiny.hidden_size,
        dtype=tiny.dtype,
        engine=receiver_engine,
        landing_pages=8,
        page_bytes=4096,
    )
    async with (
        encoder_server(tiny, transfer="mooncake", engine=encoder_engine) as (url, _, _),
        EncoderClient([url]) as client,
        receiver,
    ):
        async with fetch_embeddings(client, receiver, "r", {"image": images}) as embeddings:
            joined = embeddings.of("image")
            assert joined is not None
            # The tensor is a view of the landing pool: the encoder wrote straight into it.
            base = receiver.pool.ptr
            assert base <= joined.tensor.data_ptr() < base + receiver.pool.nbytes
            torch.testing.assert_close(joined.tensor, reference(tiny, images))
            assert receiver.stats().landing_pages_in_use > 0
        stats = receiver.stats()
        assert (stats.landing_pages_in_use, stats.quarantined_pages) == (0, 0)
    assert receiver_engine.registered_regions() == 0


async def test_a_failed_send_releases_the_part_and_frees_its_pages(
    tiny: QwenVisionModel, mooncake_engines: tuple[MooncakeEngine, MooncakeEngine]
) -> None:
    encoder_engine, receiver_engine = mooncake_engines
    receiver = EmbeddingReceiver(
        transport="mooncake",
        hidden_size=tiny.hidden_size,
        dtype=tiny.dtype,
        engine=receiver_engine,
        landing_pages=8,
        page_bytes=4096,
    )
    faults = Faults(fail={"/send": 502})
    async with (
        encoder_server(tiny, transfer="mooncake", engine=encoder_engine, faults=faults) as (
            url,
            encoder,
            _,
        ),
        EncoderClient([url]) as client,
        receiver,
    ):
        with pytest.raises(EncoderCallError) as caught:
            async with fetch_embeddings(client, receiver, "r", {"image": [data_url(56, 56)]}):
                pytest.fail("no embeddings expected")
        assert (caught.value.route, caught.value.status) == ("/send", 502)
        # The encoder answered the release, so no write can be in flight: pages are free.
        stats = receiver.stats()
        assert (stats.live_requests, stats.landing_pages_in_use, stats.quarantined_pages) == (
            0,
            0,
            0,
        )
        assert encoder.stats().live_requests == 0

        # Now the release fails too: the pages may still be written into, so they wait.
        faults.fail["/release"] = 503
        with pytest.raises(EncoderCallError):
            async with fetch_embeddings(client, receiver, "s", {"image": [data_url(56, 56)]}):
                pytest.fail("no embeddings expected")
        assert receiver.stats().quarantined_pages == 1
        # The receiver asks again; once the encoder answers, the pages come back.
        del faults.fail["/release"]
        with anyio.fail_after(10):
            while receiver.stats().held_pages:
                await anyio.sleep(0.05)
        assert (receiver.stats().held_bytes, receiver.pool.available()) == (0, 8)
        assert faults.calls.count(("/release", "s#0")) >= 2
    assert receiver_engine.registered_regions() == 0


async def test_an_error_part_fails_the_request_and_stale_parts_are_dropped(
    tiny: QwenVisionModel,
) -> None:
    receiver = EmbeddingReceiver(transport="zmq", hidden_size=64, dtype=torch.float32)
    async with receiver, ZmqPushPool() as push:
        client = EncoderClient(["http://e0"])
        plan = client.plan("r", {"image": ["a"]})
        stale = EmbeddingHeader(
            req_id="gone#0",
            num_parts=1,
            part_idx=0,
            modality="image",
            shape=(1, 64),
            dtype="float32",
            token_counts=(1,),
            grid=((1, 2, 2),),
        )
        await push.send(receiver.url, stale, payload_view(torch.zeros(1, 64)))
        async with receiver.expect(plan) as pending:
            error = EmbeddingHeader(
                req_id="r#0",
                num_parts=1,
                part_idx=0,
                modality="image",
                shape=(0, 0),
                dtype="float32",
                token_counts=(),
                grid=(),
                error="undecodable image",
                status=400,
            )
            await push.send(receiver.url, error, None)
            with anyio.fail_after(10), pytest.raises(BadRequestError, match="undecodable image"):
                await pending.wait()
        assert receiver.stats().stale_parts_dropped == 1


async def test_a_part_with_the_wrong_hidden_size_fails_only_its_request() -> None:
    receiver = EmbeddingReceiver(transport="zmq", hidden_size=64, dtype=torch.float32)
    async with receiver, ZmqPushPool() as push:
        plan = EncoderClient(["http://e0"]).plan("r", {"image": ["a"]})
        async with receiver.expect(plan) as pending:
            header = EmbeddingHeader(
                req_id="r#0",
                num_parts=1,
                part_idx=0,
                modality="image",
                shape=(2, 32),
                dtype="float32",
                token_counts=(2,),
                grid=((1, 2, 4),),
            )
            await push.send(receiver.url, header, payload_view(torch.zeros(2, 32)))
            with anyio.fail_after(10), pytest.raises(BadRequestError, match="hidden size is 32"):
                await pending.wait()
        assert receiver.stats().malformed_messages == 1


@pytest.mark.virtual_time
async def test_parts_that_never_arrive_time_out_and_are_released() -> None:
    calls: list[tuple[str, str]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.path, body["req_id"]))
        if request.url.path == "/encode":
            return httpx.Response(
                200,
                json={
                    "req_id": body["req_id"],
                    "part_idx": body["part_idx"],
                    "embedding_size": 4 * 64 * 4,
                    "embedding_len": 4,
                    "embedding_dim": 64,
                    "token_counts": [4],
                    "grid": [[1, 4, 4]],
                },
            )
        # /send "succeeds" but nothing is ever pushed.
        return httpx.Response(200, json=None)

    receiver = EmbeddingReceiver(transport="zmq", hidden_size=64, dtype=torch.float32)
    transport = httpx.MockTransport(handler)
    async with receiver, EncoderClient(["http://e0"], transport=transport) as client:
        with pytest.raises(RequestTimeoutError, match="within 20"):
            async with fetch_embeddings(client, receiver, "r", {"image": ["a"]}, timeout_s=20):
                pytest.fail("no embeddings expected")
    assert calls == [("/encode", "r#0"), ("/send", "r#0"), ("/release", "r#0")]
