"""A second ``/encode`` of a ``req_id`` that is live is refused (409) and changes nothing.

Real Hypercorn servers on the test's backend (the asyncio and the Trio worker class), the
tiny tower, real ZMQ receivers; the ``mooncake`` mode of ``--wire sglang`` runs on the
in-process ``LoopbackEngine`` as the route tests do. In every case the live request is then
delivered byte-exact, and nothing stays staged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
import torch

from encdisagg import Encoder
from encdisagg.pipeline import serve_asgi
from encdisagg.server import ServerSettings, create_app
from encdisagg.transfer import LoopbackEngine, LoopbackFabric, ZmqReceiver

from ._helpers import fast_config, png_data_url
from ._sglang_helpers import pull_sockets, sglang_encode_body
from .test_sglang_routes import HIDDEN, TOKENS, reference_bytes

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def served(
    encoder: Encoder, flavour: str, **settings: Any
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(encoder, settings=ServerSettings(**settings), flavour=flavour)  # type: ignore[arg-type]
    async with (
        serve_asgi(app, graceful_timeout_s=2.0, shutdown_timeout_s=10.0) as url,
        httpx.AsyncClient(base_url=url, timeout=30.0) as client,
    ):
        yield client


async def wait_live(encoder: Encoder, count: int) -> None:
    """Wait (bounded) until ``count`` requests are live."""
    with anyio.fail_after(10):
        while encoder.stats().live_requests != count:
            await anyio.sleep(0.01)


def assert_refused_as_live(response: httpx.Response) -> None:
    assert response.status_code == 409, response.text
    assert "live already" in response.json()["message"]


async def test_default_wire_a_duplicate_leaves_the_staged_request_to_its_send(
    anyio_backend_name: str,
) -> None:
    encoder = Encoder(fast_config())
    item = png_data_url(seed=5)
    async with served(encoder, anyio_backend_name) as client, ZmqReceiver() as receiver:
        body = {"req_id": "twice", "mm_items": [item]}
        first = await client.post("/encode", json=body)
        assert first.status_code == 200, first.text
        assert_refused_as_live(await client.post("/encode", json=body))
        response = await client.post("/send", json={"req_id": "twice", "receive_url": receiver.url})
        assert response.status_code == 200, response.text
        with anyio.fail_after(10):
            part = await receiver.receive()
        assert encoder.stats().live_requests == 0
        expected = await reference_bytes(encoder, item)
    assert part.header.req_id == "twice"
    assert part.tensor is not None
    assert part.tensor.numpy().tobytes() == expected


async def test_sglang_zmq_a_duplicate_pushes_no_error_part_to_the_live_parts_ranks(
    anyio_backend_name: str,
) -> None:
    encoder = Encoder(fast_config())
    body = sglang_encode_body("dup")  # zmq_to_scheduler: the encode waits for its rank
    with pull_sockets(1) as [rank]:
        async with served(encoder, anyio_backend_name, wire="sglang") as client:
            answers: list[httpx.Response] = []

            async def encode() -> None:
                answers.append(await client.post("/encode", json=body))

            async with anyio.create_task_group() as group:
                group.start_soon(encode)
                await wait_live(encoder, 1)
                assert_refused_as_live(await client.post("/encode", json=body))
                registration = {
                    "req_id": "dup_local_part_0",
                    "receive_count": 1,
                    "receive_url": rank.host_port,
                }
                response = await client.post("/scheduler_receive_url", json=registration)
                assert response.status_code == 200, response.text
            [answer] = answers
            assert answer.status_code == 200, answer.text
            # The first message the rank gets is the live part itself, not an error part.
            header, frames = await rank.receive()
            expected = await reference_bytes(encoder, body["mm_items"][0])
            assert encoder.stats().live_requests == 0
    assert header["error_msg"] is None
    assert header["req_id"] == "dup_local_part_0"
    assert frames[1] == expected


async def test_sglang_mooncake_a_duplicate_leaves_the_part_to_its_send(
    anyio_backend_name: str,
) -> None:
    fabric = LoopbackFabric()
    rank = LoopbackEngine(fabric, name="prefill-0")
    buffer = torch.zeros(TOKENS * HIDDEN, dtype=torch.float32)
    rank.register(buffer.data_ptr(), buffer.numel() * 4)
    encoder = Encoder(fast_config(transfer="loopback"), engine=LoopbackEngine(fabric))
    body = sglang_encode_body("mcdup")
    try:
        with pull_sockets(1) as [notice]:
            async with served(encoder, anyio_backend_name, wire="sglang") as client:
                first = await client.post("/encode", json=body)
                assert first.status_code == 200, first.text
                assert_refused_as_live(await client.post("/encode", json=body))
                meta = await client.post(
                    "/scheduler_receive_meta_data",
                    json={"req_id": "mcdup_local_part_0", "part_idx": 0},
                )
                assert meta.status_code == 200, meta.text
                send = dict(meta.json())
                send.update(
                    prefill_host="127.0.0.1",
                    embedding_port=notice.port,
                    session_id="prefill-0",
                    buffer_address=buffer.data_ptr(),
                    receive_count=1,
                )
                response = await client.post("/send", json=send)
                assert response.status_code == 200, response.text
                header, _ = await notice.receive()
                # Delivered, so released at once; not left for its send deadline.
                assert encoder.stats().live_requests == 0
                expected = await reference_bytes(encoder, body["mm_items"][0])
    finally:
        rank.deregister(buffer.data_ptr())
    assert header["req_id"] == "mcdup_local_part_0"
    assert header["error_msg"] is None
    assert buffer.numpy().tobytes() == expected
