"""EncoderClient against real encoders over real HTTP, and its failure paths."""

from __future__ import annotations

import base64
import io
import json
import pickle
import re
import socket
from pathlib import Path

import anyio
import httpx
import numpy as np
import pytest
from PIL import Image

from encdisagg import BadRequestError, Modality
from encdisagg.models import QwenVisionModel, load_model
from encdisagg.receiver import EncoderCallError, EncoderClient, ZmqSendTarget

from ._encoder_app import Faults
from .conftest import data_url, encoder_server

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tiny_b() -> QwenVisionModel:
    # A second instance: two encoders must not share one model's forward.
    return load_model("tiny")


async def test_parts_spread_over_encoders_and_report_their_layout(
    tiny: QwenVisionModel, tiny_b: QwenVisionModel
) -> None:
    images = [data_url(56, 56, 1), data_url(84, 56, 2), data_url(112, 112, 3)]
    async with (
        encoder_server(tiny) as (url_a, _, faults_a),
        encoder_server(tiny_b) as (url_b, _, faults_b),
        EncoderClient([url_a, url_b]) as client,
    ):
        plan = client.plan("r", {"image": images})
        assert [p.url for p in plan.parts] == [url_a, url_b]
        metadata = await client.encode(plan)
        assert [m.req_id for m in metadata] == ["r#0", "r#1"]
        expected = tiny.preprocess(images, Modality.IMAGE)
        assert sum((m.token_counts for m in metadata), ()) == expected.token_counts
        assert sum((m.grid for m in metadata), ()) == expected.grid
        assert metadata[0].embedding_dim == tiny.hidden_size
        assert await client.release(plan.parts) == {"r#0", "r#1"}
        # The next request starts at the next encoder.
        assert client.plan("s", {"image": images[:1]}).parts[0].url == url_b
    assert ("/encode", "r#0") in faults_a.calls
    assert ("/encode", "r#1") in faults_b.calls


async def test_a_failing_encoder_is_named_and_the_other_parts_are_released(
    tiny: QwenVisionModel, tiny_b: QwenVisionModel
) -> None:
    images = [data_url(56, 56, 1), data_url(56, 56, 2)]
    async with (
        encoder_server(tiny) as (url_a, _, faults_a),
        encoder_server(tiny_b, faults=Faults(fail={"/encode": 400})) as (url_b, _, _),
        EncoderClient([url_a, url_b]) as client,
    ):
        plan = client.plan("r", {"image": images})
        with pytest.raises(EncoderCallError) as caught:
            await client.encode(plan)
        error = caught.value
        assert (error.url, error.status, error.part_idx, error.route) == (url_b, 400, 1, "/encode")
        assert url_b in str(error)
        assert "injected" in str(error)
        assert ("/release", "r#0") in faults_a.calls
        copy = pickle.loads(pickle.dumps(error))
        assert (copy.url, copy.status, copy.part_idx) == (url_b, 400, 1)


async def test_an_unreachable_encoder_is_a_502() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    async with EncoderClient([url], connect_timeout_s=2.0) as client:
        plan = client.plan("r", {"image": ["x"]})
        with pytest.raises(EncoderCallError) as caught:
            await client.encode_part(plan.parts[0])
    assert (caught.value.status, caught.value.url) == (502, url)
    assert "could not be reached" in str(caught.value)


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


def _metadata(req_id: str, part_idx: int) -> dict[str, object]:
    return {
        "req_id": req_id,
        "part_idx": part_idx,
        "embedding_size": 4 * 64 * 4,
        "embedding_len": 4,
        "embedding_dim": 64,
        "token_counts": [4],
        "grid": [[1, 4, 4]],
    }


@pytest.mark.virtual_time
async def test_a_silent_encoder_times_out_as_504() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/encode":
            await anyio.sleep_forever()
        return httpx.Response(200, json=None)

    transport = httpx.MockTransport(handler)
    async with EncoderClient(["http://e0"], encode_timeout_s=30.0, transport=transport) as client:
        plan = client.plan("r", {"image": ["x"]})
        start = anyio.current_time()
        with pytest.raises(EncoderCallError) as caught:
            await client.encode(plan)
        assert anyio.current_time() - start == pytest.approx(30.0, abs=1.0)
    assert caught.value.status == 504
    assert "within 30.0 s" in str(caught.value)


@pytest.mark.virtual_time
async def test_one_failure_cancels_its_siblings_at_once() -> None:
    seen: list[tuple[str, str]] = []
    cancelled: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body["req_id"]))
        if request.url.path == "/encode" and body["req_id"] == "r#0":
            try:
                await anyio.sleep_forever()
            finally:
                cancelled.append(body["req_id"])
        if request.url.path == "/encode":
            await anyio.sleep(1.0)
            return httpx.Response(503, json={"status": "error", "message": "draining"})
        return httpx.Response(200, json=None)

    transport = httpx.MockTransport(handler)
    async with EncoderClient(
        ["http://e0", "http://e1"], encode_timeout_s=600.0, transport=transport
    ) as client:
        plan = client.plan("r", {"image": ["a", "b"]})
        start = anyio.current_time()
        with pytest.raises(EncoderCallError) as caught:
            await client.encode(plan)
        assert anyio.current_time() - start < 5.0
    assert (caught.value.url, caught.value.status, caught.value.part_idx) == ("http://e1", 503, 1)
    assert cancelled == ["r#0"]
    assert {("/release", "r#0"), ("/release", "r#1")} <= set(seen)


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (json.dumps(_metadata("other#0", 0)).encode(), "answered for 'other#0'"),
        (b"not json", "not JSON"),
        (
            json.dumps(
                {**_metadata("r#0", 0), "token_counts": [2, 2], "grid": [[1, 2, 4], [1, 2, 4]]}
            ).encode(),
            "2 token counts",
        ),
        (json.dumps({**_metadata("r#0", 0), "dtype": "float32"}).encode(), "unknown field"),
    ],
)
async def test_answers_that_break_the_contract_are_refused(answer: bytes, match: str) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/encode":
            return httpx.Response(200, content=answer)
        return httpx.Response(200, content=b"null")

    async with EncoderClient(["http://e0"], transport=httpx.MockTransport(handler)) as client:
        part = client.plan("r", {"image": ["x"]}).parts[0]
        with pytest.raises(EncoderCallError, match=match) as caught:
            await client.encode_part(part)
        assert caught.value.status == 502
        # /send answers only with its status.
        await client.send(part, ZmqSendTarget("tcp://127.0.0.1:1"))


async def test_cancelling_encode_still_releases_the_dispatched_parts() -> None:
    seen: list[tuple[str, str]] = []
    started = anyio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body["req_id"]))
        if request.url.path == "/encode":
            started.set()
            await anyio.sleep_forever()
        return httpx.Response(200, json=None)

    async with EncoderClient(["http://e0"], transport=httpx.MockTransport(handler)) as client:
        plan = client.plan("r", {"image": ["x"]})
        async with anyio.create_task_group() as group:
            group.start_soon(client.encode, plan)
            await started.wait()
            group.cancel_scope.cancel()
    assert ("/release", "r#0") in seen


async def test_release_outcome_tells_confirmed_held_and_unconfirmed_apart() -> None:
    # One encoder per way a release can end.
    async def handler(request: httpx.Request) -> httpx.Response:
        req_id = json.loads(request.content)["req_id"]
        host = request.url.host
        if host == "confirms":
            return httpx.Response(200, json=None)
        if host == "holds":
            # The encoder itself: its write may still land.
            message = f"req_id {req_id!r} is released, but a transfer may still land"
            return httpx.Response(
                504, json={"status": "error", "message": message, "req_id": req_id}
            )
        if host == "refuses":
            return httpx.Response(503, json={"status": "error", "message": "draining"})
        if host == "gateway":
            # A proxy in front of the encoder gave up: nobody knows what the encoder did.
            return httpx.Response(504, text="upstream timed out")
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    urls = ["http://confirms", "http://holds", "http://refuses", "http://gateway", "http://silent"]
    transport = httpx.MockTransport(handler)
    async with EncoderClient(urls, release_timeout_s=0.5, transport=transport) as client:
        parts = client.plan("r", {"image": ["a", "b", "c", "d", "e"]}).parts
        assert [part.url for part in parts] == urls
        outcome = await client.release_outcome(parts)
        assert outcome.confirmed == {"r#0"}
        assert outcome.held == {"r#1"}
        # Refused, answered by something else than the encoder, or not answered in time.
        assert outcome.unconfirmed == {"r#2", "r#3", "r#4"}
        # release() still answers with the confirmed ids alone.
        assert await client.release(parts[:2]) == {"r#0"}
        # Asking again, one part at a time, as a receiver does while pages are held.
        assert await client.release_confirmed(parts[0]) is True
        assert await client.release_confirmed(parts[1]) is False
        assert await client.release_confirmed(parts[3]) is False


async def test_the_client_takes_the_items_an_encoder_takes(
    tiny: QwenVisionModel, tmp_path: Path
) -> None:
    png = base64.b64decode(data_url(84, 56, 4).partition(",")[2])
    on_disk = tmp_path / "photo.png"
    on_disk.write_bytes(base64.b64decode(data_url(56, 112, 5).partition(",")[2]))
    image = Image.open(io.BytesIO(base64.b64decode(data_url(112, 56, 6).partition(",")[2])))
    items: list[object] = [png, bytearray(png), on_disk, image, data_url(56, 56, 7)]
    async with encoder_server(tiny) as (url, _, _), EncoderClient([url]) as client:
        plan = client.plan("r", {"image": items})
        (metadata,) = await client.encode(plan)
        await client.release(plan.parts)
    expected = tiny.preprocess(items, Modality.IMAGE)
    assert metadata.token_counts == expected.token_counts
    assert metadata.grid == expected.grid


@pytest.mark.parametrize(
    ("item", "said"),
    [
        (np.zeros(16_000, dtype=np.float32), "mm_items[1]: a NumPy waveform cannot be sent"),
        (object(), "mm_items[1]: unsupported item type object"),
    ],
)
async def test_an_item_that_cannot_travel_is_refused_naming_it(
    item: object, said: str, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    async with EncoderClient([url]) as client:
        plan = client.plan("r", {"image": ["x", item]})
        with pytest.raises(BadRequestError, match=re.escape(said)):
            await client.encode_part(plan.parts[0])
        missing = client.plan("s", {"image": [tmp_path / "missing.png"]})
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: cannot read"):
            await client.encode_part(missing.parts[0])
