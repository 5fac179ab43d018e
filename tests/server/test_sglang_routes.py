"""``--wire sglang``: SGLang's bodies accepted, its three transfer modes, its header frames.

The app runs the real tiny tower. SGLang's receivers are played by real ZMQ PULL sockets
(header frames read back by the tests' allow-listing unpickler) and, for ``mooncake``, by a
``LoopbackEngine`` buffer; ``test_sglang_mooncake.py`` does the same over real Mooncake TCP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch
from quart import Quart

from encdisagg import Encoder, EncodeRequest, ZmqDestination
from encdisagg.transfer import LoopbackEngine, LoopbackFabric, ZmqReceiver

from ..transfer._sglang_unpickle import StandInDtype, StandInModality, StandInTensor
from ._helpers import fast_config, png_bytes, png_data_url, running
from ._sglang_helpers import pull_sockets, sglang_encode_body

pytestmark = pytest.mark.anyio

# 224x224 → grid (1, 16, 16) → 64 tokens of the tiny tower's 64 floats (float32).
TOKENS = 64
HIDDEN = 64


async def reference_bytes(encoder: Encoder, item: object, req_id: str = "reference") -> bytes:
    """The embedding of ``item`` as a local encode gives it (our own wire)."""
    async with ZmqReceiver() as receiver:
        await encoder.encode(EncodeRequest(req_id, [item]))
        await encoder.send(req_id, ZmqDestination(receiver.url))
        part = await receiver.receive()
    assert part.tensor is not None
    return part.tensor.numpy().tobytes()


def _expected_header(req_id: str, *, part_idx: int = 0, num_parts: int = 1) -> dict[str, Any]:
    return {
        "req_id": req_id,
        "num_parts": num_parts,
        "part_idx": part_idx,
        "grid_dim": StandInTensor([[1, 16, 16]]),
        "modality": StandInModality(1),
        "embedding": None,
        "dtype": StandInDtype("float32"),
        "shape": [TOKENS, HIDDEN],
        "_mr_ptr": None,
        "error_msg": None,
        "error_code": None,
        "video_timestamps": None,
        "second_per_grid_ts": None,
    }


async def test_zmq_to_tokenizer_pushes_during_encode_and_answers_null(
    make_app: Callable[..., Quart],
) -> None:
    encoder = Encoder(fast_config())
    with pull_sockets(1) as [tokenizer]:
        async with running(make_app(encoder, wire="sglang")) as client:
            body = sglang_encode_body("9a1f", embedding_port=tokenizer.port)
            response = await client.post("/encode", json=body)
            assert response.status_code == 200, await response.get_data()
            assert await response.get_json() is None
            header, frames = await tokenizer.receive()
            expected = await reference_bytes(encoder, body["mm_items"][0])
            assert encoder.stats().live_requests == 0
    send_time = header.pop("send_time")
    assert isinstance(send_time, float)
    assert header == _expected_header("9a1f_local_part_0")
    assert len(frames) == 2
    assert frames[1] == expected


async def test_zmq_to_scheduler_waits_for_every_rank_before_or_after_encode(
    make_app: Callable[..., Quart],
) -> None:
    encoder = Encoder(fast_config())
    with pull_sockets(2) as ranks:
        async with running(make_app(encoder, wire="sglang")) as client:

            def registration(rank: int, count: int = 2) -> dict[str, Any]:
                return {
                    "req_id": "77c0_local_part_1",
                    "receive_count": count,
                    "receive_url": ranks[rank].host_port,
                    "modality": "IMAGE",
                }

            # Rank 0 registers before /encode, rank 1 while it waits.
            response = await client.post("/scheduler_receive_url", json=registration(0))
            assert response.status_code == 200
            assert await response.get_json() is None
            answers: list[Any] = []

            async def encode() -> None:
                body = sglang_encode_body("77c0", part_idx=1, num_parts=2)
                response = await client.post("/encode", json=body)
                answers.append((response.status_code, await response.get_json()))

            async with anyio.create_task_group() as group:
                group.start_soon(encode)
                await anyio.wait_all_tasks_blocked()
                response = await client.post("/scheduler_receive_url", json=registration(1, 3))
                assert response.status_code == 400
                assert "Inconsistent receive_count" in (await response.get_json())["message"]
                response = await client.post("/scheduler_receive_url", json=registration(1))
                assert response.status_code == 200
            assert answers == [(200, None)]
            received = [await rank.receive() for rank in ranks]
            late = await client.post("/scheduler_receive_url", json=registration(1))
            assert late.status_code == 400
            assert "not active" in (await late.get_json())["message"]
            expected = await reference_bytes(encoder, png_data_url(seed=1))
    for header, frames in received:
        header.pop("send_time")
        assert header == _expected_header("77c0_local_part_1", part_idx=1, num_parts=2)
        assert frames[1] == expected


async def test_legacy_scheduler_port_list_pushes_to_each_port(
    make_app: Callable[..., Quart],
) -> None:
    with pull_sockets(2) as ranks:
        async with running(make_app(wire="sglang")) as client:
            body = sglang_encode_body("legacy", embedding_port=[r.port for r in ranks])
            response = await client.post("/encode", json=body)
            assert response.status_code == 200
            received = [await rank.receive() for rank in ranks]
    assert received[0][1] == received[1][1]
    assert received[0][0]["req_id"] == "legacy_local_part_0"


async def test_a_bad_item_is_an_error_part_and_a_400_with_its_message(
    make_app: Callable[..., Quart],
) -> None:
    with pull_sockets(1) as [tokenizer]:
        async with running(make_app(wire="sglang")) as client:
            body = sglang_encode_body(
                "bad", embedding_port=tokenizer.port, items=["data:image/png;base64,AAAA"]
            )
            response = await client.post("/encode", json=body)
            answer = await response.get_json()
            header, frames = await tokenizer.receive()
    assert response.status_code == 400
    assert "mm_items[0]" in answer["message"]
    assert len(frames) == 1
    assert header["error_msg"] == answer["message"]
    assert header["error_code"] == 400
    assert header["req_id"] == "bad_local_part_0"
    assert header["shape"] is None


async def test_a_failed_part_reaches_ranks_registering_later(
    make_app: Callable[..., Quart],
) -> None:
    config = fast_config(request_timeout_s=30.0)
    with pull_sockets(1) as [rank]:
        async with running(make_app(config, wire="sglang")) as client:
            body = sglang_encode_body("late", items=["data:image/png;base64,AAAA"])
            assert (await client.post("/encode", json=body)).status_code == 400
            registration = {
                "req_id": "late_local_part_0",
                "receive_count": 1,
                "receive_url": rank.host_port,
                "modality": "IMAGE",
            }
            response = await client.post("/scheduler_receive_url", json=registration)
            assert response.status_code == 200
            header, frames = await rank.receive()
    assert len(frames) == 1
    assert header["error_code"] == 400
    assert "mm_items[0]" in header["error_msg"]


@pytest.mark.parametrize(
    "variant",
    [
        "url strings",
        "dict items with content_hash",
        "hashes list",
        "hashes scalar",
        "time_stats_json object",
        "time_stats_json string",
        "lowercase modality",
        "no modality",
    ],
)
async def test_every_body_sglang_sends_is_accepted(
    make_app: Callable[..., Quart], variant: str
) -> None:
    import hashlib

    image = png_bytes(seed=3)
    items: list[Any] = [png_data_url(seed=3)]
    extra: dict[str, Any] = {}
    if variant == "dict items with content_hash":
        items = [{"url": items[0], "content_hash": hashlib.sha256(image).hexdigest()}]
    elif variant == "hashes list":
        extra["hashes"] = ["4f1e9a"]
    elif variant == "hashes scalar":
        extra["hashes"] = 1234567
    elif variant == "time_stats_json object":
        extra["time_stats_json"] = {"trace_id": "abc"}
    elif variant == "time_stats_json string":
        extra["time_stats_json"] = '{"trace_id": "abc"}'
    elif variant == "lowercase modality":
        extra["modality"] = "image"
    elif variant == "no modality":
        extra["modality"] = None
    with pull_sockets(1) as [tokenizer]:
        async with running(make_app(wire="sglang")) as client:
            body = sglang_encode_body("v", embedding_port=tokenizer.port, items=items, **extra)
            response = await client.post("/encode", json=body)
            assert response.status_code == 200, await response.get_data()
            header, frames = await tokenizer.receive()
    assert header["shape"] == [TOKENS, HIDDEN]
    assert len(frames[1]) == TOKENS * HIDDEN * 4


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"embedding_port": 0}, "embedding_port"),
        ({"embedding_port": [5000, "x"]}, "embedding_port[1]"),
        ({"embedding_port": True}, "embedding_port"),
        ({"prefill_host": None, "embedding_port": 5000}, "prefill_host"),
        ({"encoder_idx": "0"}, "encoder_idx"),
        ({"hashes": ["a", "b"]}, "hashes"),
        ({"surprise": 1}, "surprise"),
        ({"num_parts": 0}, "num_parts"),
    ],
)
async def test_wrong_fields_are_400_naming_the_field(
    make_app: Callable[..., Quart], changes: dict[str, Any], field: str
) -> None:
    async with running(make_app(wire="sglang")) as client:
        body = sglang_encode_body("w", embedding_port=5000)
        body.update(changes)
        response = await client.post("/encode", json=body)
        assert response.status_code == 400
        assert field in (await response.get_json())["message"]


async def test_mooncake_mode_answers_sizes_then_send_writes_and_notifies(
    make_app: Callable[..., Quart],
) -> None:
    fabric = LoopbackFabric()
    ranks = [LoopbackEngine(fabric, name=f"prefill-{rank}") for rank in range(2)]
    buffers = [torch.zeros(TOKENS * HIDDEN, dtype=torch.float32) for _ in ranks]
    for engine, buffer in zip(ranks, buffers, strict=True):
        engine.register(buffer.data_ptr(), buffer.numel() * 4)
    encoder = Encoder(fast_config(transfer="loopback"), engine=LoopbackEngine(fabric))
    try:
        with pull_sockets(2) as notices:
            async with running(make_app(encoder, wire="sglang")) as client:
                body = sglang_encode_body("mc")
                response = await client.post("/encode", json=body)
                assert response.status_code == 200, await response.get_data()
                answer = await response.get_json()
                expected_answer = {k: v for k, v in body.items() if k != "mm_items"}
                expected_answer.update(
                    embedding_size=TOKENS * HIDDEN * 4,
                    embedding_len=TOKENS,
                    embedding_dim=HIDDEN,
                )
                assert answer == expected_answer
                meta = await client.post(
                    "/scheduler_receive_meta_data",
                    json={"req_id": "mc_local_part_0", "part_idx": 0},
                )
                metadata = await meta.get_json()
                assert metadata == {
                    "req_id": "mc_local_part_0",
                    "part_idx": 0,
                    "embedding_size": TOKENS * HIDDEN * 4,
                    "embedding_len": TOKENS,
                    "embedding_dim": HIDDEN,
                }
                for rank, (buffer, notice) in enumerate(zip(buffers, notices, strict=True)):
                    # SGLang's receiver posts the metadata answer back, plus its buffer.
                    send = dict(metadata)
                    send.update(
                        prefill_host="127.0.0.1",
                        embedding_port=notice.port,
                        session_id=f"prefill-{rank}",
                        buffer_address=buffer.data_ptr(),
                        receive_count=2,
                    )
                    response = await client.post("/send", json=send)
                    assert response.status_code == 200, await response.get_data()
                    assert await response.get_json() is None
                assert encoder.stats().live_requests == 0
                headers = [await notice.receive() for notice in notices]
                expected = await reference_bytes(encoder, body["mm_items"][0])
                again = await client.post("/send", json=send)
                assert again.status_code == 500
    finally:
        for engine, buffer in zip(ranks, buffers, strict=True):
            engine.deregister(buffer.data_ptr())
    for (header, frames), buffer in zip(headers, buffers, strict=True):
        assert len(frames) == 1
        header.pop("send_time")
        assert header == _expected_header("mc_local_part_0")
        assert buffer.numpy().tobytes() == expected


async def test_mooncake_metadata_of_a_failed_part_is_500_with_its_message(
    make_app: Callable[..., Quart],
) -> None:
    encoder = Encoder(fast_config(transfer="loopback"), engine=LoopbackEngine(LoopbackFabric()))
    async with running(make_app(encoder, wire="sglang")) as client:
        body = sglang_encode_body("mf", items=["data:image/png;base64,AAAA"])
        response = await client.post("/encode", json=body)
        assert response.status_code == 400
        message = (await response.get_json())["message"]
        meta = await client.post(
            "/scheduler_receive_meta_data", json={"req_id": "mf_local_part_0", "part_idx": 0}
        )
        assert meta.status_code == 500
        assert (await meta.get_json())["message"] == message


async def test_send_without_mooncake_is_400_and_health_generate_answers(
    make_app: Callable[..., Quart],
) -> None:
    async with running(make_app(wire="sglang")) as client:
        send = {
            "req_id": "x_local_part_0",
            "part_idx": 0,
            "embedding_size": 4,
            "embedding_len": 1,
            "embedding_dim": 1,
            "prefill_host": "127.0.0.1",
            "embedding_port": 5000,
            "session_id": "127.0.0.1:17000",
            "buffer_address": 4096,
            "receive_count": 1,
        }
        response = await client.post("/send", json=send)
        assert response.status_code == 400
        assert "mooncake" in (await response.get_json())["message"]
        assert (await client.get("/health_generate")).status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_the_default_wire_keeps_our_bodies(make_app: Callable[..., Quart]) -> None:
    async with running(make_app()) as client:
        response = await client.post("/encode", json=sglang_encode_body("ours", embedding_port=1))
        assert response.status_code == 400
        assert (await client.get("/health_generate")).status_code == 404


async def test_health_generate_is_logged_by_its_name(
    make_app: Callable[..., Quart], caplog: pytest.LogCaptureFixture
) -> None:
    async with running(make_app(wire="sglang")) as client:
        with caplog.at_level("INFO", logger="encdisagg.server.access"):
            assert (await client.get("/health_generate")).status_code == 200
    assert any("/health_generate" in record.getMessage() for record in caplog.records)
