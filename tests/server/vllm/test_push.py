"""``--vllm-connector mooncake``: the push to a PD's TP shards, served, over real Mooncake TCP.

The consumer is a stand-in (``_consumer``): real ZMQ REP sockets speaking the control
protocol, and receive buffers registered with real Mooncake engines on loopback. The
Encoder writes with its own engine, from its registered memory.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from quart import Quart

from encdisagg import ConfigError, Encoder
from encdisagg.transfer import MooncakeEngine

from .._helpers import fast_config, png_data_url, running
from ..test_sglang_routes import reference_bytes
from ._bodies import chat_body, image_item, mooncake_params
from ._consumer import fake_consumer

pytestmark = [pytest.mark.anyio, pytest.mark.mooncake]

CHAT = "/v1/chat/completions"
#: The tiny model's 224x224 image: 64 tokens of 64 float32 columns.
NBYTES = 64 * 64 * 4


def _app(make_app: Callable[..., Quart], encoder: Encoder) -> Quart:
    return make_app(encoder, wire="vllm", vllm_connector="mooncake")


async def test_every_shard_gets_the_bytes_before_the_answer(
    make_app: Callable[..., Quart], shard_engines: list[MooncakeEngine]
) -> None:
    encoder = Encoder(fast_config(transfer="mooncake"))
    with fake_consumer(shard_engines, "write", "write") as consumer:
        async with running(_app(make_app, encoder)) as client:
            body = chat_body(
                image_item("m0", seed=2),
                ec_transfer_params=mooncake_params(consumer.address, "tid-0"),
            )
            response = await client.post(CHAT, json=body)
            assert response.status_code == 200, await response.get_data()
            # Answered only once every shard completed.
            assert [shard.ops for shard in consumer.shards] == [
                ["peers", "reserve_batch", "complete_batch"],
                ["reserve_batch", "complete_batch"],
            ]
            assert encoder.stats().live_requests == 0
            expected = await reference_bytes(encoder, png_data_url(seed=2))
        landed = [shard.landed(NBYTES) for shard in consumer.shards]
        reserve = consumer.shards[1].requests[0]["items"][0]
    assert (await response.get_json())["ec_transfer_params"]["m0"] == {
        "modality": "image",
        "item_indices": [0],
        "metadata": {"image_grid_thw": [1, 16, 16]},
        "transfer_id": "tid-0",
    }
    assert reserve == {
        "transfer_id": "tid-0",
        "mm_hash": "m0",
        "nbytes": NBYTES,
        "shape": [64, 64],
        "dtype": "float32",
    }
    assert landed == [expected, expected]


@pytest.mark.parametrize("mode", ["no-write", "cached", "cancelled"])
async def test_shards_that_need_no_write_are_left_alone(
    make_app: Callable[..., Quart], shard_engines: list[MooncakeEngine], mode: str
) -> None:
    encoder = Encoder(fast_config(transfer="mooncake"))
    with fake_consumer(shard_engines, "write", mode) as consumer:
        async with running(_app(make_app, encoder)) as client:
            body = chat_body(
                image_item("m1"), ec_transfer_params=mooncake_params(consumer.address, "t")
            )
            response = await client.post(CHAT, json=body)
            assert response.status_code == 200, await response.get_data()
        written, other = consumer.shards
        assert written.ops == ["peers", "reserve_batch", "complete_batch"]
        assert other.ops == ["reserve_batch"]
        assert not other.buffer.any()
        assert written.buffer[:NBYTES].any()


async def test_a_failed_reservation_cancels_the_others_and_answers_500(
    make_app: Callable[..., Quart], shard_engines: list[MooncakeEngine]
) -> None:
    encoder = Encoder(fast_config(transfer="mooncake"))
    with fake_consumer(shard_engines, "write", "full") as consumer:
        async with running(_app(make_app, encoder)) as client:
            body = chat_body(
                image_item("m2"), ec_transfer_params=mooncake_params(consumer.address, "t2")
            )
            response = await client.post(CHAT, json=body)
            assert response.status_code == 500
            error = (await response.get_json())["error"]
            assert encoder.stats().live_requests == 0
        first, full = consumer.shards
        assert first.ops == ["peers", "reserve_batch", "cancel"]
        assert first.requests[-1] == {
            "op": "cancel",
            "transfer_id": "t2",
            "reservation_id": f"res-{first.port}-0",
            "abandon": True,
        }
        assert full.ops == ["reserve_batch"]
        assert not first.buffer.any()
    assert error["type"] == "InternalServerError"
    assert "buffer pool is full" in error["message"]


async def test_a_refused_completion_cancels_every_reservation(
    make_app: Callable[..., Quart], shard_engines: list[MooncakeEngine]
) -> None:
    encoder = Encoder(fast_config(transfer="mooncake"))
    with fake_consumer(shard_engines, "write", "complete-fails") as consumer:
        async with running(_app(make_app, encoder)) as client:
            body = chat_body(
                image_item("m3"), ec_transfer_params=mooncake_params(consumer.address, "t3")
            )
            response = await client.post(CHAT, json=body)
            assert response.status_code == 500
        assert [shard.ops[-2:] for shard in consumer.shards] == [["complete_batch", "cancel"]] * 2
        assert all(shard.requests[-1]["abandon"] is True for shard in consumer.shards)


async def test_a_mooncake_body_is_needed(
    make_app: Callable[..., Quart], shard_engines: list[MooncakeEngine]
) -> None:
    encoder = Encoder(fast_config(transfer="mooncake"))
    async with running(_app(make_app, encoder)) as client:
        response = await client.post(CHAT, json=chat_body(image_item("m4")))
        assert response.status_code == 400
        assert "ec_transfer_params is missing" in (await response.get_json())["error"]["message"]


async def test_mooncake_needs_the_mooncake_transfer(make_app: Callable[..., Quart]) -> None:
    with pytest.raises(ConfigError, match="needs transfer='mooncake'"):
        make_app(fast_config(), wire="vllm", vllm_connector="mooncake")


# One event loop: starting worker processes (each imports torch and opens its own Mooncake
# engine) is what takes the time here; the front's loop is covered by the tests above.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_data_parallel_workers_push_with_their_own_engines(
    make_app: Callable[..., Quart], shard_engines: list[MooncakeEngine]
) -> None:
    app = make_app(fast_config(transfer="mooncake"), dp=2, wire="vllm", vllm_connector="mooncake")
    with fake_consumer(shard_engines, "write", "write") as consumer:
        async with running(app) as client:
            body = chat_body(
                image_item("p0", seed=1),
                image_item("p1", seed=2),
                ec_transfer_params=mooncake_params(consumer.address, "ta", "tb"),
            )
            response = await client.post(CHAT, json=body)
            assert response.status_code == 200, await response.get_data()
        completed = sorted(
            request["items"][0]["transfer_id"]
            for shard in consumer.shards
            for request in shard.requests
            if request["op"] == "complete_batch"
        )
    assert completed == ["ta", "ta", "tb", "tb"]
