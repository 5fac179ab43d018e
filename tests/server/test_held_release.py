"""``POST /send`` and ``POST /release`` of a part whose Mooncake write's outcome is unknown.

The Encoder writes through a real :class:`MooncakeEngine` over a scripted stand-in for
Mooncake's pybind engine (``tests/encoder/_mooncake_fakes.py``) that leaves the write
unfinished while answering TIMED_OUT. A timed-out delivery answers 504, apart from a failed
one (502); a release answers 504 for as long as the write may still land, and ``null`` once
Mooncake reported the write ended.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
from quart import Quart

from encdisagg import Encoder, EncoderConfig, EncodeRequest
from tests.encoder._mooncake_fakes import ScriptedMooncake, scripted_mooncake
from tests.encoder.fakes import ScriptedModel

from ._helpers import fast_config, running
from ._sglang_helpers import pull_sockets, sglang_encode_body

pytestmark = pytest.mark.anyio

__all__ = ["scripted_mooncake"]

SEND = {
    "req_id": "r1",
    "session_id": "peer:1",
    "buffer_address": 0x7000_0000,
    "prefill_host": "peer",
    "embedding_port": 1,
}


@pytest.mark.parametrize("outcome", ["timeout", "fail"])
async def test_a_timed_out_send_is_504_and_its_release_says_the_write_may_still_land(
    make_app: Callable[..., Quart], scripted_mooncake: ScriptedMooncake, outcome: str
) -> None:
    fake = scripted_mooncake
    fake.plan = [outcome]
    config = EncoderConfig(transfer="mooncake", staging_arena_mb=0, cleanup_timeout_s=1.0)
    encoder = Encoder(config, model=ScriptedModel())
    async with running(make_app(encoder)) as client:
        await encoder.encode(EncodeRequest("r1", [64]))
        response = await client.post("/send", json=SEND)
        answer = await response.get_json()
        assert answer["status"] == "error"
        assert answer["req_id"] == "r1"
        release = await client.post("/release", json={"req_id": "r1"})
        if outcome == "fail":
            # A failed write ended: the delivery failed (502), and nothing is held.
            assert response.status_code == 502
            assert release.status_code == 200
            assert await release.get_data() == b"null"
            return
        assert response.status_code == 504
        assert "'r1'" in answer["message"]
        assert release.status_code == 504
        held = await release.get_json()
        assert held["req_id"] == "r1"
        assert "may still land" in held["message"]
        metrics = await (await client.get("/metrics")).get_data(as_text=True)
        assert "encdisagg_held_bytes 1024" in metrics
        fake.finish()
        with anyio.fail_after(10):
            while encoder.stats().held_bytes:
                await anyio.sleep(0.01)
        release = await client.post("/release", json={"req_id": "r1"})
        assert release.status_code == 200
    assert fake.violations == []


async def test_the_sglang_wire_answers_a_timed_out_write_504(
    make_app: Callable[..., Quart], scripted_mooncake: ScriptedMooncake
) -> None:
    # SGLang's own /send answers 500 for every failure (its receiver fails fast); a write
    # whose outcome is unknown answers 504, as SGLang 0.5.23 does, so it is told apart.
    fake = scripted_mooncake
    fake.plan = ["timeout"]
    encoder = Encoder(fast_config(transfer="mooncake", staging_arena_mb=0))
    with pull_sockets(1) as (notice,):
        async with running(make_app(encoder, wire="sglang")) as client:
            body = sglang_encode_body("tcp")
            assert (await client.post("/encode", json=body)).status_code == 200
            meta = await client.post(
                "/scheduler_receive_meta_data", json={"req_id": "tcp_local_part_0", "part_idx": 0}
            )
            send = dict(await meta.get_json())
            send.update(
                prefill_host="127.0.0.1",
                embedding_port=notice.port,
                session_id="peer:1",
                buffer_address=0x7000_0000,
            )
            response = await client.post("/send", json=send)
            assert response.status_code == 504, await response.get_data()
            assert "tcp_local_part_0" in (await response.get_json())["message"]
            fake.finish()
            with anyio.fail_after(10):
                while encoder.stats().held_bytes:
                    await anyio.sleep(0.01)
    assert fake.violations == []
