"""Every route, success and error, in-process, on both flavours (Quart and QuartTrio).

The app runs the real tiny Qwen2-VL tower on real PNG images; deliveries go to a real
``ZmqReceiver`` or, for the Mooncake fields, to a ``LoopbackEngine`` buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import pytest
import torch
from quart import Quart

from encdisagg import Encoder, EncodeRequest
from encdisagg.server import EncodeBody
from encdisagg.transfer import LoopbackEngine, LoopbackFabric, ZmqReceiver

from ..transfer._zmq_helpers import free_tcp_url
from ._helpers import fast_config, png_data_url, running

pytestmark = pytest.mark.anyio

# 224x224 → grid (1, 16, 16) → 64 tokens of the tiny tower's 64 floats (float32).
TOKENS = 64
HIDDEN = 64


def encode_body(req_id: str, *, seed: int = 0, **extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "req_id": req_id,
        "mm_items": [png_data_url(seed=seed)],
        "modality": "image",
        "num_parts": 1,
        "part_idx": 0,
    }
    body.update(extra)
    return body


async def test_encode_metadata_release(make_app: Callable[..., Quart]) -> None:
    async with running(make_app()) as client:
        response = await client.post("/encode", json=encode_body("r1"))
        assert response.status_code == 200
        answer = await response.get_json()
        assert answer == {
            "req_id": "r1",
            "part_idx": 0,
            "embedding_size": TOKENS * HIDDEN * 4,
            "embedding_len": TOKENS,
            "embedding_dim": HIDDEN,
            "token_counts": [TOKENS],
            "grid": [[1, 16, 16]],
        }
        response = await client.post(
            "/scheduler_receive_meta_data", json={"req_id": "r1", "part_idx": 0}
        )
        assert response.status_code == 200
        assert await response.get_json() == answer

        response = await client.post("/release", json={"req_id": "r1"})
        assert response.status_code == 200
        assert await response.get_data() == b"null"
        # Released: later calls see it gone.
        response = await client.post(
            "/scheduler_receive_meta_data", json={"req_id": "r1", "part_idx": 0}
        )
        assert response.status_code == 409
        assert (await response.get_json())["req_id"] == "r1"
        response = await client.post("/release", json={"req_id": "r1"})
        assert response.status_code == 200, "release is idempotent"


async def test_multi_part_and_multi_item(make_app: Callable[..., Quart]) -> None:
    async with running(make_app()) as client:
        body = {
            "req_id": "p1",
            "mm_items": [png_data_url(seed=1), {"url": png_data_url(112, 112, seed=2)}],
            "modality": "IMAGE",
            "num_parts": 3,
            "part_idx": 2,
        }
        response = await client.post("/encode", json=body)
        assert response.status_code == 200
        answer = await response.get_json()
        assert answer["part_idx"] == 2
        assert answer["token_counts"] == [TOKENS, 16]
        assert answer["embedding_len"] == TOKENS + 16
        await client.post("/release", json={"req_id": "p1"})


async def test_send_zmq_delivers_and_releases(make_app: Callable[..., Quart]) -> None:
    async with ZmqReceiver() as receiver, running(make_app()) as client:
        assert (await client.post("/encode", json=encode_body("z1"))).status_code == 200
        response = await client.post("/send", json={"req_id": "z1", "receive_url": receiver.url})
        assert response.status_code == 200
        assert await response.get_data() == b"null"
        with anyio.fail_after(10):
            part = await receiver.receive()
        assert part.header.req_id == "z1"
        assert tuple(part.header.shape) == (TOKENS, HIDDEN)
        assert part.tensor is not None
        assert torch.isfinite(part.tensor).all()
        # receive_count defaults to 1: delivered once, the request is gone.
        again = await client.post("/send", json={"req_id": "z1", "receive_url": receiver.url})
        assert again.status_code == 409


async def test_send_receive_count_two_destinations(make_app: Callable[..., Quart]) -> None:
    async with (
        ZmqReceiver() as first,
        ZmqReceiver() as second,
        running(make_app()) as client,
    ):
        assert (await client.post("/encode", json=encode_body("z2"))).status_code == 200
        for receiver in (first, first, second):  # a retry from one destination counts once
            response = await client.post(
                "/send", json={"req_id": "z2", "receive_url": receiver.url, "receive_count": 2}
            )
            assert response.status_code == 200, await response.get_data()
        with anyio.fail_after(10):
            for receiver in (first, first, second):
                assert (await receiver.receive()).header.req_id == "z2"
        response = await client.post("/send", json={"req_id": "z2", "receive_url": first.url})
        assert response.status_code == 409


async def test_push_mode_registration_before_encode(make_app: Callable[..., Quart]) -> None:
    async with ZmqReceiver() as receiver, running(make_app()) as client:
        host_port = receiver.url.removeprefix("tcp://")  # SGLang receivers send host:port
        registered: list[int] = []

        async def register() -> None:
            response = await client.post(
                "/scheduler_receive_url",
                json={"req_id": "push", "receive_count": 1, "receive_url": host_port},
            )
            registered.append(response.status_code)

        async with anyio.create_task_group() as group:
            group.start_soon(register)
            await anyio.sleep(0.05)
            response = await client.post("/encode", json=encode_body("push"))
            assert response.status_code == 200
        assert registered == [200]
        with anyio.fail_after(10):
            part = await receiver.receive()
        assert part.header.req_id == "push"
        assert tuple(part.header.shape) == (TOKENS, HIDDEN)


async def test_send_mooncake_fields_write_into_the_receivers_buffer(
    make_app: Callable[..., Quart],
) -> None:
    fabric = LoopbackFabric()
    receiving = LoopbackEngine(fabric, name="prefill-0")
    buffer = torch.zeros(TOKENS * HIDDEN, dtype=torch.float32)
    receiving.register(buffer.data_ptr(), buffer.numel() * 4)
    encoder = Encoder(fast_config(transfer="loopback"), engine=LoopbackEngine(fabric))
    try:
        async with running(make_app(encoder)) as client:
            assert (await client.post("/encode", json=encode_body("m1"))).status_code == 200
            response = await client.post(
                "/send",
                json={
                    "req_id": "m1",
                    "session_id": "prefill-0",
                    "buffer_address": buffer.data_ptr(),
                    "prefill_host": "127.0.0.1",
                    "embedding_port": 5757,
                    "receive_count": 1,
                    # Echoed metadata, as SGLang's receivers send it.
                    "part_idx": 0,
                    "embedding_size": TOKENS * HIDDEN * 4,
                    "embedding_len": TOKENS,
                    "embedding_dim": HIDDEN,
                },
            )
            assert response.status_code == 200, await response.get_data()
            assert encoder.stats().live_requests == 0
        assert buffer.abs().sum() > 0, "the embedding landed in the receiver's buffer"
    finally:
        receiving.deregister(buffer.data_ptr())


async def test_send_mooncake_without_engine_is_a_transfer_error(
    make_app: Callable[..., Quart],
) -> None:
    async with running(make_app()) as client:
        assert (await client.post("/encode", json=encode_body("m2"))).status_code == 200
        response = await client.post(
            "/send",
            json={
                "req_id": "m2",
                "session_id": "127.0.0.1:1",
                "buffer_address": 4096,
                "prefill_host": "127.0.0.1",
                "embedding_port": 1,
            },
        )
        assert response.status_code == 502
        answer = await response.get_json()
        assert answer["status"] == "error"
        assert answer["req_id"] == "m2"
        assert "mooncake" in answer["message"].lower()


async def test_send_to_a_receiver_that_refuses_fails_fast_and_frees_the_request(
    make_app: Callable[..., Quart],
) -> None:
    """Nothing listens at the receive URL: ``/send`` answers 502 once the endpoint has
    refused for ``zmq_refused_grace_s``, not after the (here ten-minute) send timeout."""
    encoder = Encoder(
        fast_config(zmq_send_timeout_s=600, send_timeout_s=600, zmq_refused_grace_s=0.2)
    )
    async with running(make_app(encoder)) as client:
        assert (await client.post("/encode", json=encode_body("gone"))).status_code == 200
        with anyio.fail_after(60):
            response = await client.post(
                "/send", json={"req_id": "gone", "receive_url": free_tcp_url()}
            )
        assert response.status_code == 502
        answer = await response.get_json()
        assert answer["req_id"] == "gone"
        assert "refused every connection attempt" in answer["message"]
        assert encoder.stats().live_requests == 0


async def test_unknown_and_duplicate_ids(make_app: Callable[..., Quart]) -> None:
    config = fast_config(request_timeout_s=0.3, zmq_send_timeout_s=0.3)
    async with running(make_app(config)) as client:
        response = await client.post("/send", json={"req_id": "ghost", "receive_url": "tcp://x:1"})
        assert response.status_code == 404
        assert (await response.get_json())["req_id"] == "ghost"
        response = await client.post(
            "/scheduler_receive_meta_data", json={"req_id": "ghost", "part_idx": 0}
        )
        assert response.status_code == 504
        response = await client.post(
            "/scheduler_receive_url",
            json={"req_id": "ghost", "receive_count": 1, "receive_url": "tcp://127.0.0.1:9"},
        )
        assert response.status_code == 504
        assert (await client.post("/release", json={"req_id": "ghost"})).status_code == 200

        assert (await client.post("/encode", json=encode_body("dup"))).status_code == 200
        response = await client.post("/encode", json=encode_body("dup"))
        assert response.status_code == 409
        assert (await response.get_json())["req_id"] == "dup"
        response = await client.post(
            "/scheduler_receive_url",
            json={"req_id": "dup", "receive_count": 2, "receive_url": "tcp://127.0.0.1:9"},
        )
        assert response.status_code == 200
        response = await client.post(
            "/scheduler_receive_url",
            json={"req_id": "dup", "receive_count": 3, "receive_url": "tcp://127.0.0.1:9"},
        )
        assert response.status_code == 400
        assert "receive_count" in (await response.get_json())["message"]
        await client.post("/release", json={"req_id": "dup"})


async def test_bad_media_is_400_and_leaves_nothing(make_app: Callable[..., Quart]) -> None:
    encoder = Encoder(fast_config())
    async with running(make_app(encoder)) as client:
        response = await client.post(
            "/encode", json={"req_id": "bad", "mm_items": ["data:image/png;base64,AAAA"]}
        )
        assert response.status_code == 400
        answer = await response.get_json()
        assert answer["req_id"] == "bad"
        assert "mm_items[0]" in answer["message"]
        assert encoder.stats().live_requests == 0


async def test_local_files_are_refused(make_app: Callable[..., Quart], tmp_path: object) -> None:
    async with running(make_app()) as client:
        for item in ("/etc/hostname", "file:///etc/hostname", {"url": "/etc/hostname"}):
            response = await client.post("/encode", json={"req_id": "f", "mm_items": [item]})
            assert response.status_code == 400
            assert "local file" in (await response.get_json())["message"]


async def test_body_over_the_limit_is_413(make_app: Callable[..., Quart]) -> None:
    async with running(make_app(max_body_bytes=4096)) as client:
        big = {"req_id": "big", "mm_items": ["QUFB" * 2000]}
        response = await client.post("/encode", json=big)
        assert response.status_code == 413
        answer = await response.get_json()
        assert answer["status"] == "error"
        assert "4096" in answer["message"]
        assert (await client.post("/release", json={"req_id": "x"})).status_code == 200


async def test_unknown_route_and_method_are_json_errors(make_app: Callable[..., Quart]) -> None:
    async with running(make_app()) as client:
        response = await client.get("/nope")
        assert response.status_code == 404
        assert (await response.get_json())["status"] == "error"
        response = await client.get("/encode")
        assert response.status_code == 405
        assert (await response.get_json())["status"] == "error"


async def test_unexpected_exception_is_a_logged_500_without_details(
    make_app: Callable[..., Quart],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def explode(body: object) -> EncodeBody:
        raise RuntimeError("secret internals")

    async with running(make_app()) as client:
        monkeypatch.setattr(EncodeBody, "from_json", explode)
        with caplog.at_level(logging.ERROR, logger="encdisagg.server"):
            response = await client.post("/encode", json=encode_body("boom"))
        assert response.status_code == 500
        text = (await response.get_data()).decode()
        assert "secret" not in text
        assert (await response.get_json()) == {
            "status": "error",
            "message": "internal server error",
            "req_id": None,
        }
        assert any(
            record.exc_info and "secret internals" in str(record.exc_info[1])
            for record in caplog.records
        )


async def test_health_and_metrics(make_app: Callable[..., Quart]) -> None:
    encoder = Encoder(fast_config(prefix_cache_mb=8))
    app = make_app(encoder)
    async with running(app) as client:
        response = await client.get("/health")
        assert response.status_code == 200
        assert await response.get_json() == {"status": "ok", "probed": True}
        assert encoder.stats().live_requests == 0, "the probe's request was released"

        for req_id in ("c1", "c2"):  # the same image twice: one miss, one hit
            assert (await client.post("/encode", json=encode_body(req_id))).status_code == 200
            await client.post("/release", json={"req_id": req_id})
        await client.post("/encode", json={"req_id": "c3", "mm_items": ["bad"]})

        response = await client.get("/metrics")
        assert response.status_code == 200
        assert response.content_type.startswith("text/plain")
        text = (await response.get_data()).decode()
    # Built from a given Encoder, the app sees no encoder events, but gauges and cache counts.
    assert "encdisagg_cache_hits_total 1.0" in text
    assert "encdisagg_cache_misses_total" in text
    assert "encdisagg_live_requests 0.0" in text
    assert "encdisagg_staged_bytes 0.0" in text
    assert 'encdisagg_http_requests_total{code="400",route="/encode"} 1.0' in text
    assert 'encdisagg_http_requests_total{code="200",route="/health"} 1.0' in text


async def test_metrics_from_encoder_events(make_app: Callable[..., Quart]) -> None:
    async with ZmqReceiver() as receiver, running(make_app()) as client:
        assert (await client.post("/encode", json=encode_body("e1"))).status_code == 200
        await client.post("/send", json={"req_id": "e1", "receive_url": receiver.url})
        await receiver.receive()
        await client.post("/encode", json={"req_id": "e2", "mm_items": ["bad"]})
        text = (await (await client.get("/metrics")).get_data()).decode()
    assert 'encdisagg_requests_total{modality="image",status="ok"} 1.0' in text
    assert 'encdisagg_requests_total{modality="image",status="bad_request"} 1.0' in text
    assert "encdisagg_request_seconds_count 2.0" in text  # the failed encode counts too
    for name in ("queue", "preprocess", "forward", "transfer", "queue_and_forward"):
        assert f"encdisagg_{name}_seconds_count 1.0" in text, name
    assert "encdisagg_queue_seconds_bucket" in text
    assert "encdisagg_inflight_transfers 0.0" in text


async def test_given_encoder_is_used_directly(make_app: Callable[..., Quart]) -> None:
    encoder = Encoder(fast_config())
    async with encoder:
        async with running(make_app(encoder)) as client:
            assert (await client.post("/encode", json=encode_body("g1"))).status_code == 200
        # The app did not own it: still open, and the request is still there.
        assert encoder.is_open
        result = await encoder.wait_metadata("g1")
        assert result.num_tokens == TOKENS
        await encoder.release("g1")
        direct = await encoder.encode(EncodeRequest("g2", [png_data_url()]))
        assert direct.num_tokens == TOKENS
        await encoder.release("g2")
