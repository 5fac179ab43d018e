"""``--wire sglang`` in SGLang's ``mooncake`` mode over real Mooncake TCP (loopback).

Two scheduler ranks each register a buffer with an engine of their own, post SGLang's
``/send`` (the metadata answer plus their buffer) and wait for the completion notice on
their PULL socket; the bytes that landed equal a local encode's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest
import torch
from anyio.from_thread import start_blocking_portal
from quart import Quart

from encdisagg import Encoder
from encdisagg.transfer import MooncakeEngine

from ._helpers import fast_config, running
from ._sglang_helpers import pull_sockets, sglang_encode_body
from .test_sglang_routes import HIDDEN, TOKENS, reference_bytes

pytestmark = [pytest.mark.anyio, pytest.mark.mooncake]


@pytest.fixture(scope="module")
def rank_engines() -> Iterator[list[MooncakeEngine]]:
    pytest.importorskip("mooncake.engine")
    with start_blocking_portal() as portal, ExitStack() as stack:
        yield [
            stack.enter_context(portal.wrap_async_context_manager(MooncakeEngine()))
            for _ in range(2)
        ]


async def test_two_ranks_get_the_bytes_and_a_notice_each(
    make_app: Callable[..., Quart], rank_engines: list[MooncakeEngine]
) -> None:
    buffers = [torch.zeros(TOKENS * HIDDEN, dtype=torch.float32) for _ in rank_engines]
    for engine, buffer in zip(rank_engines, buffers, strict=True):
        engine.register(buffer.data_ptr(), buffer.numel() * 4)
    encoder = Encoder(fast_config(transfer="mooncake"))
    try:
        with pull_sockets(2) as notices:
            async with running(make_app(encoder, wire="sglang")) as client:
                body = sglang_encode_body("tcp")
                assert (await client.post("/encode", json=body)).status_code == 200
                meta = await client.post(
                    "/scheduler_receive_meta_data",
                    json={"req_id": "tcp_local_part_0", "part_idx": 0},
                )
                metadata = await meta.get_json()
                for engine, buffer, notice in zip(rank_engines, buffers, notices, strict=True):
                    send = dict(metadata)
                    send.update(
                        prefill_host="127.0.0.1",
                        embedding_port=notice.port,
                        session_id=engine.session_id,
                        buffer_address=buffer.data_ptr(),
                        receive_count=2,
                    )
                    response = await client.post("/send", json=send)
                    assert response.status_code == 200, await response.get_data()
                headers = [await notice.receive() for notice in notices]
                assert encoder.stats().live_requests == 0
                expected = await reference_bytes(encoder, body["mm_items"][0])
    finally:
        for engine, buffer in zip(rank_engines, buffers, strict=True):
            engine.deregister(buffer.data_ptr())
    for (header, frames), buffer in zip(headers, buffers, strict=True):
        assert len(frames) == 1
        assert header["shape"] == [TOKENS, HIDDEN]
        assert header["req_id"] == "tcp_local_part_0"
        assert buffer.numpy().tobytes() == expected
