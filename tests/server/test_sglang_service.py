"""SglangService called directly (as the gRPC service calls it), over an open Encoder."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
import zmq

from encdisagg import BadRequestError, Encoder, RequestTimeoutError, TransferError
from encdisagg.server._sglang._service import SglangService

from ._helpers import fast_config
from ._sglang_helpers import pull_sockets, sglang_encode_body

pytestmark = pytest.mark.anyio


async def test_built_from_an_encoder_it_encodes_and_pushes() -> None:
    with pull_sockets(1) as [tokenizer]:
        async with Encoder(fast_config()) as encoder, SglangService(encoder) as sglang:
            assert not sglang.mooncake
            body = sglang_encode_body("direct", embedding_port=tokenizer.port)
            assert await sglang.encode(body) is None
            header, frames = await tokenizer.receive()
            assert encoder.stats().live_requests == 0
    assert header["req_id"] == "direct_local_part_0"
    assert len(frames) == 2


async def test_ranks_that_never_register_time_out_and_late_ones_get_the_error() -> None:
    config = fast_config(request_timeout_s=0.5)
    with pull_sockets(1) as [rank]:
        async with Encoder(config) as encoder, SglangService(encoder) as sglang:
            with pytest.raises(RequestTimeoutError, match="0 of \\? scheduler destinations"):
                await sglang.encode(sglang_encode_body("lonely"))
            assert encoder.stats().live_requests == 0
            registration = {
                "req_id": "lonely_local_part_0",
                "receive_count": 1,
                "receive_url": rank.host_port,
            }
            assert await sglang.scheduler_receive_url(registration) is None
            header, frames = await rank.receive()
    assert len(frames) == 1
    assert header["error_code"] == 504
    assert "scheduler destinations" in header["error_msg"]


async def test_calls_outside_the_block_and_with_curve_are_refused() -> None:
    public, _secret = zmq.curve_keypair()
    with pytest.raises(BadRequestError, match="CURVE"):
        SglangService(Encoder(fast_config(zmq_curve_server_key=public.decode())))
    async with Encoder(fast_config()) as encoder:
        sglang = SglangService(encoder)
        with pytest.raises(TransferError, match="not running"):
            await sglang.encode(sglang_encode_body("early", embedding_port=5000))
        with pytest.raises(BadRequestError, match="mm_items"):
            await sglang.encode({"req_id": "x"})


async def test_a_cancelled_encode_waiting_for_ranks_releases_its_part() -> None:
    async with Encoder(fast_config()) as encoder, SglangService(encoder) as sglang:
        async with anyio.create_task_group() as group:
            group.start_soon(sglang.encode, sglang_encode_body("gone"))
            with anyio.fail_after(30):
                # Staged, and waiting for registrations that never come.
                while encoder.stats().staged_bytes == 0:
                    await anyio.wait_all_tasks_blocked()
                    await anyio.lowlevel.checkpoint()
            await anyio.wait_all_tasks_blocked()
            group.cancel_scope.cancel()
        assert encoder.stats().live_requests == 0
        assert encoder.stats().staged_bytes == 0


async def test_a_rank_that_is_gone_fails_the_part_and_only_the_others_hear_of_it() -> None:
    with pull_sockets(2) as [alive, gone]:
        gone.close()  # a rank that failed earlier closed its socket
        async with (
            Encoder(fast_config(zmq_send_timeout_s=0.5)) as encoder,
            SglangService(encoder) as sglang,
        ):
            for rank in (alive, gone):
                await sglang.scheduler_receive_url(
                    {
                        "req_id": "half_local_part_0",
                        "receive_count": 2,
                        "receive_url": rank.host_port,
                    }
                )
            with pytest.raises(TransferError, match=r"half_local_part_0.* timed out after 0\.5 s"):
                await sglang.encode(sglang_encode_body("half"))
            assert encoder.stats().live_requests == 0
            data, data_frames = await alive.receive()
            error, error_frames = await alive.receive()
    assert len(data_frames) == 2
    assert data["error_msg"] is None
    assert len(error_frames) == 1
    assert error["error_code"] == 502


def _gif_data_url(frames: int) -> str:
    import base64
    import io

    from PIL import Image

    images = [Image.new("RGB", (84, 56), (40 * n % 256, 90, 160)) for n in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, "GIF", save_all=True, append_images=images[1:], duration=250)
    return "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ("tiny-qwen3-vl", "video_timestamps"),
        ("tiny-qwen2.5-vl", "second_per_grid_ts"),
        ("tiny", None),
    ],
)
async def test_a_video_part_carries_the_timing_field_its_model_reads(
    model: str, field: str | None
) -> None:
    from ..transfer._sglang_unpickle import StandInModality, StandInTensor

    with pull_sockets(1) as [tokenizer]:
        async with (
            Encoder(fast_config(model=model)) as encoder,
            SglangService(encoder) as sglang,
        ):
            body = sglang_encode_body(
                "clip", embedding_port=tokenizer.port, items=[_gif_data_url(4)], modality="VIDEO"
            )
            assert await sglang.encode(body) is None
            header, _frames = await tokenizer.receive()
    assert header["modality"] == StandInModality(2)
    (steps, _h, _w) = header["grid_dim"].rows[0]
    others = {"video_timestamps", "second_per_grid_ts"} - {field}
    for other in others:
        assert header[other] is None
    if field == "video_timestamps":
        (stamps,) = header[field]
        assert len(stamps) == steps
        assert stamps == sorted(stamps)
    elif field == "second_per_grid_ts":
        assert isinstance(header[field], StandInTensor)
        (seconds,) = header[field].rows
        assert seconds > 0
