"""The Encoder with the parts a user meets: the tiny HF model, real ZMQ sockets, the loopback
engine, and the Mooncake transfer engine over TCP with the receiver in another process."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from anyio.streams.buffered import BufferedByteReceiveStream
from PIL import Image

from encdisagg import (
    BadRequestError,
    Encoder,
    EncodeRequest,
    Modality,
    MooncakeDestination,
    ZmqDestination,
)
from encdisagg.models import QwenVisionModel, load_model
from encdisagg.transfer import MooncakeEngine, ZmqReceiver

from .._device import chosen_device
from ._device_models import DeviceScriptedModel
from .fakes import ScriptedModel

pytestmark = pytest.mark.anyio

MakeEncoder = Callable[..., Encoder]
PEER = Path(__file__).parents[1] / "transfer" / "_mooncake_peer.py"


@pytest.fixture(scope="module")
def tiny() -> QwenVisionModel:
    """The tiny model on the tests' device (``ENCDISAGG_TEST_DEVICE``, the CPU by default)."""
    model = load_model("tiny", device=str(chosen_device()))
    assert isinstance(model, QwenVisionModel)
    return model


def png(width: int, height: int, seed: int = 0) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def expected_embedding(model: Any, items: list[object]) -> torch.Tensor:
    pre = model.preprocess(items, Modality.IMAGE)
    return torch.cat(model.forward([pre]))


@pytest.mark.device
async def test_tiny_model_embedding_reaches_a_zmq_receiver(
    make_encoder: MakeEncoder, tiny: QwenVisionModel
) -> None:
    image = png(448, 448)
    async with ZmqReceiver() as receiver, make_encoder(model=tiny) as encoder:
        result = await encoder.encode(EncodeRequest("img", [image], num_parts=2, part_idx=1))
        assert result.num_tokens == 256
        assert result.grid == ((1, 32, 32),)
        assert result.hidden_size == tiny.hidden_size
        await encoder.send("img", ZmqDestination(receiver.url))
        with anyio.fail_after(30):
            part = await receiver.receive()
        assert part.header.req_id == "img"
        assert (part.header.num_parts, part.header.part_idx) == (2, 1)
        assert part.header.shape == (256, tiny.hidden_size)
        assert part.header.token_counts == (256,)
        assert part.tensor is not None
        # Recomputed here, on another thread than the Encoder's forward: the parallel
        # reductions may split differently, so equal up to float16 rounding, not bit for bit.
        torch.testing.assert_close(part.tensor, expected_embedding(tiny, [image]).cpu())
    assert encoder.stats().live_requests == 0


async def test_push_mode_registration_before_encode(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    async with ZmqReceiver() as a, ZmqReceiver() as b, make_encoder(model=model) as encoder:
        async with anyio.create_task_group() as tg:
            tg.start_soon(encoder.register_destinations, "r1", 2, [a.url, b.url])
            await anyio.wait_all_tasks_blocked()
            await encoder.encode(EncodeRequest("r1", [3, 5]))
        with anyio.fail_after(30):
            parts = [await a.receive(), await b.receive()]
        expected = expected_embedding(model, [3, 5])
        for part in parts:
            assert part.header.token_counts == (3, 5)
            assert part.tensor is not None
            assert torch.equal(part.tensor, expected)
        with anyio.fail_after(30):
            while encoder.stats().live_requests:
                await anyio.sleep(0.01)


async def test_push_mode_sends_an_error_part_for_a_failed_encode(
    make_encoder: MakeEncoder,
) -> None:
    async with ZmqReceiver() as receiver, make_encoder() as encoder:
        async with anyio.create_task_group() as tg:
            tg.start_soon(encoder.register_destinations, "r1", 1, [receiver.url])
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(BadRequestError):
                await encoder.encode(EncodeRequest("r1", ["bad"]))
        with anyio.fail_after(30):
            part = await receiver.receive()
        assert part.tensor is None
        assert part.header.status == 400
        assert part.header.error is not None
        assert "cannot decode" in part.header.error


async def test_loopback_engine_delivers_into_a_registered_buffer(
    make_encoder: MakeEncoder,
) -> None:
    model = ScriptedModel()
    async with make_encoder(model=model, transfer="loopback") as encoder:
        engine = encoder.engine
        assert engine is not None
        result = await encoder.encode(EncodeRequest("r1", [7]))
        landing = torch.zeros(result.nbytes, dtype=torch.uint8)
        engine.register(landing.data_ptr(), result.nbytes)
        try:
            destination = MooncakeDestination(engine.session_id, landing.data_ptr(), "local:1")
            await encoder.send("r1", destination)
        finally:
            engine.deregister(landing.data_ptr())
        received = landing.view(torch.float16).reshape(result.num_tokens, result.hidden_size)
        assert torch.equal(received, expected_embedding(model, [7]))


async def _read_json(lines: BufferedByteReceiveStream) -> Any:
    return json.loads(await lines.receive_until(b"\n", 1 << 16))


@pytest.mark.parametrize(
    "poll_on_loop_s", [0.1, 0.0], ids=["polled-on-the-loop", "polled-by-the-thread"]
)
@pytest.mark.device
async def test_staged_embedding_crosses_processes_over_mooncake_tcp(
    make_encoder: MakeEncoder, tmp_path: Path, poll_on_loop_s: float
) -> None:
    # On the tests' device (ENCDISAGG_TEST_DEVICE) the engine reads device memory.
    model = DeviceScriptedModel(hidden_size=64, dtype=torch.float16)
    stderr_path = tmp_path / "peer.stderr"
    config = {"transfer": "mooncake", "mooncake_poll_on_loop_s": poll_on_loop_s}
    async with make_encoder(model=model, **config) as encoder:
        assert isinstance(encoder.engine, MooncakeEngine)
        assert encoder.engine.poll_on_loop_s == poll_on_loop_s
        result = await encoder.encode(EncodeRequest("mc", [512, 300]))
        assert encoder.stats().registered_regions == 1
        expected = expected_embedding(model, [512, 300]).cpu()
        digest = hashlib.sha256(expected.view(torch.uint8).numpy().tobytes()).hexdigest()
        with anyio.fail_after(60), stderr_path.open("wb") as stderr:
            process = await anyio.open_process(
                [sys.executable, str(PEER), str(result.nbytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
            async with process:
                assert process.stdin is not None
                assert process.stdout is not None
                lines = BufferedByteReceiveStream(process.stdout)
                peer = await _read_json(lines)
                destination = MooncakeDestination(peer["session_id"], peer["ptr"], "peer:1")
                await encoder.send("mc", destination)
                # Delivered to its one destination: released and deregistered.
                assert encoder.stats().live_requests == 0
                assert encoder.stats().registered_regions == 0
                await process.stdin.send(b"digest\n")
                assert await _read_json(lines) == {"sha256": digest}, stderr_path.read_text()
                await process.stdin.send(b"exit\n")
                assert await _read_json(lines) == {"regions_after_exit": 0}
                assert await process.wait() == 0, stderr_path.read_text()
