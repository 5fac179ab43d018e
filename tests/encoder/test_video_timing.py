"""The Encoder publishes a video's timing with its metadata, pushes it in the ZMQ header, and
keeps it on a prefix-cache hit (the embedding is reused, the timing is the request's own)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from encdisagg import Encoder, EncodeRequest, ZmqDestination
from encdisagg._video_timing import video_timing
from encdisagg.models import QwenVisionModel, load_model
from encdisagg.transfer import ZmqReceiver

from ..models._media_samples import encode, make_image

pytestmark = pytest.mark.anyio

MakeEncoder = Callable[..., Encoder]


@pytest.fixture(scope="module")
def tiny25() -> QwenVisionModel:
    return load_model("tiny-qwen2.5-vl")


def _video(fps: float | None) -> dict[str, Any]:
    item: dict[str, Any] = {"frames": [encode(make_image(56, 56, n)) for n in range(5)]}
    if fps is not None:
        item["fps"] = fps
    return item


async def test_timing_reaches_the_result_and_the_header(
    make_encoder: MakeEncoder, tiny25: QwenVisionModel
) -> None:
    async with ZmqReceiver() as receiver, make_encoder(model=tiny25, prefix_cache_mb=64) as enc:
        first = await enc.encode(EncodeRequest("v1", [_video(4)], modality="video"))
        assert first.video_timing == (video_timing(5, 2, fps=4),)
        await enc.send("v1", ZmqDestination(receiver.url))
        with anyio.fail_after(30):
            part = await receiver.receive()
        assert part.header.video_timing == first.video_timing
        # The same frames at another rate: the cached embedding, this request's timing.
        second = await enc.encode(EncodeRequest("v2", [_video(None)], modality="video"))
        assert enc.stats().cache_entries == 1
        assert second.video_timing == (video_timing(5, 2, fps=2),)
        await enc.release("v2")
        image = await enc.encode(EncodeRequest("i", [encode(make_image(56, 56))]))
        assert image.video_timing is None
        await enc.release("i")
