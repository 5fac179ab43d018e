"""The SGLang wire over data-parallel workers: the worker holding a part pushes SGLang's
header frame with the bytes itself, and the header travels to it inside the send call."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from quart import Quart

from encdisagg import BadRequestError
from encdisagg.encoder._types import SglangZmqDestination
from encdisagg.server import SendBody

from ._helpers import fast_config, running
from ._sglang_helpers import pull_sockets, sglang_encode_body

pytestmark = pytest.mark.anyio


def test_the_header_travels_in_the_workers_send_call_and_only_there() -> None:
    destination = SglangZmqDestination("tcp://127.0.0.1:5555", b"\x80\x02header")
    wire = SendBody("r", destination, 2).to_wire()
    assert wire["sglang_header"] == b"\x80\x02header"
    assert SendBody.from_json(wire, internal=True) == SendBody("r", destination, 2)
    with pytest.raises(BadRequestError, match="unknown field 'sglang_header'"):
        SendBody.from_json(wire)
    with pytest.raises(BadRequestError, match="sglang_header must be bytes, got str"):
        SendBody.from_json(wire | {"sglang_header": "text"}, internal=True)


async def test_workers_push_sglang_frames_to_every_rank(make_app: Callable[..., Quart]) -> None:
    config = fast_config(model="null", request_timeout_s=30, zmq_send_timeout_s=30)
    app = make_app(config, wire="sglang", dp=2, worker_start_timeout_s=120)
    with pull_sockets(2) as ranks:
        async with running(app) as client:
            for rid in ("dp-a", "dp-b", "dp-c"):
                body = sglang_encode_body(rid, embedding_port=[rank.port for rank in ranks])
                response = await client.post("/encode", json=body)
                assert response.status_code == 200, await response.get_data()
                received = [await rank.receive() for rank in ranks]
                assert received[0][1] == received[1][1]
                header, frames = received[0]
                assert header["req_id"] == f"{rid}_local_part_0"
                assert header["error_msg"] is None
                assert header["shape"] == [16, 64]
                assert len(frames) == 2
                assert len(frames[1]) == 16 * 64 * 2  # the null model's float16
