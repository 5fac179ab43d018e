"""Video timing (fps, second_per_grid_ts, timestamps) against transformers' own processors,
and what the Qwen models' ``preprocess`` reports for frame lists, rates and files."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from encdisagg import BadRequestError
from encdisagg._video_timing import (
    DEFAULT_VIDEO_FPS,
    VideoTiming,
    check_video_timing,
    frame_timestamps,
    timing_from_wire,
    timing_to_wire,
    video_timing,
)
from encdisagg.models import QwenVisionModel

from ._media_samples import make_image

# (frames, fps): even and odd frame counts (the last temporal patch repeats a frame), one
# frame, and rates below, at and above the default.
CASES = [(8, 2.0), (5, 2.0), (1, 2.0), (16, 1.0), (7, 4.0), (30, 29.97), (12, 0.5)]


class _FakeVideoProcessor:
    """Stands in for the torchvision-only Qwen2-VL video processor: the grids and metadata
    of frames handed over already sampled (``frames_indices`` 0..F-1 at ``fps``)."""

    temporal_patch_size = 2

    def __init__(self, fps: float) -> None:
        self.fps = fps

    def __call__(self, videos: list[list[object]], **_: object) -> dict[str, Any]:
        return {
            "video_grid_thw": [[-(-len(v) // 2), 4, 4] for v in videos],
            "video_metadata": [
                VideoMetadata(
                    total_num_frames=len(v), fps=self.fps, frames_indices=[*range(len(v))]
                )
                for v in videos
            ],
        }


def upstream_second_per_grid_ts(frames: int, fps: float) -> float:
    """What ``Qwen2_5_VLProcessor._process_videos`` computes for pre-sampled frames."""
    processor = object.__new__(Qwen2_5_VLProcessor)
    processor.video_processor = _FakeVideoProcessor(fps)
    processor.video_token = None
    data, _ = processor._process_videos([[None] * frames])
    (value,) = data["second_per_grid_ts"]
    return float(value)


def upstream_timestamps(indices: list[int], fps: float, temporal_patch_size: int) -> list[float]:
    """What ``Qwen3VLProcessor`` writes before each temporal patch (its self is unused)."""
    return list(Qwen3VLProcessor._calculate_timestamps(None, indices, fps, temporal_patch_size))


class TestAgainstUpstream:
    @pytest.mark.parametrize(("frames", "fps"), CASES)
    def test_frames_at_a_rate(self, frames: int, fps: float) -> None:
        timing = video_timing(frames, 2, fps=fps)
        assert timing.fps == fps
        assert timing.second_per_grid_ts == upstream_second_per_grid_ts(frames, fps)
        assert list(timing.timestamps) == upstream_timestamps([*range(frames)], fps, 2)
        assert len(timing.timestamps) == -(-frames // 2)

    @pytest.mark.parametrize("temporal_patch_size", [1, 2, 4])
    def test_sampled_indices_of_a_longer_video(self, temporal_patch_size: int) -> None:
        # Every 15th frame of a 30 fps source: 2 frames per second.
        indices = [*range(0, 300, 15)]
        times = [index / 30.0 for index in indices]
        timing = video_timing(len(indices), temporal_patch_size, frame_times=times)
        assert timing.fps == pytest.approx(2.0)
        expected = upstream_timestamps(indices, 30.0, temporal_patch_size)
        assert list(timing.timestamps) == pytest.approx(expected, abs=1e-12)
        assert list(frame_timestamps(times, temporal_patch_size)) == pytest.approx(expected)

    def test_default_rate(self) -> None:
        # The Qwen video processors' ``fps = 2`` and SGLang's encoder default (torchvision-only
        # modules, so stated here rather than read from them).
        assert DEFAULT_VIDEO_FPS == 2.0
        assert video_timing(4, 2) == video_timing(4, 2, fps=2.0)

    def test_refusals(self) -> None:
        with pytest.raises(ValueError, match="at least one frame"):
            video_timing(0, 2)
        with pytest.raises(ValueError, match="fps"):
            video_timing(4, 2, fps=0)
        with pytest.raises(ValueError, match="frame times"):
            video_timing(4, 2, frame_times=[0.0, 1.0])
        with pytest.raises(ValueError, match="backwards"):
            video_timing(2, 2, frame_times=[1.0, 0.5])


def _frames(count: int, seed: int = 0) -> list[Image.Image]:
    return [make_image(84, 56, seed=seed + number) for number in range(count)]


class TestPreprocess:
    @pytest.mark.parametrize(("frames", "fps"), [(8, 2.0), (5, 4.0), (3, 1.0)])
    def test_frames_with_a_rate(self, tiny25: QwenVisionModel, frames: int, fps: float) -> None:
        pre = tiny25.preprocess([{"frames": _frames(frames), "fps": fps}], "video")
        assert pre.video_timing is not None
        (timing,) = pre.video_timing
        assert pre.grid[0][0] == len(timing.timestamps)
        assert timing.second_per_grid_ts == upstream_second_per_grid_ts(frames, fps)
        assert list(timing.timestamps) == upstream_timestamps([*range(frames)], fps, 2)

    def test_batched_items_each_get_their_own(self, tiny: QwenVisionModel) -> None:
        items = [_frames(4), {"frames": _frames(6, 10), "fps": 3}, {"frames": _frames(1, 20)}]
        pre = tiny.preprocess(items, "video")
        assert pre.video_timing == (
            video_timing(4, 2),
            video_timing(6, 2, fps=3),
            video_timing(1, 2),
        )
        # Unbatched: the same values one at a time.
        for item, timing in zip(items, pre.video_timing, strict=True):
            assert tiny.preprocess([item], "video").video_timing == (timing,)
        check_video_timing(pre.video_timing, modality="video", grid=pre.grid, where="test")

    def test_rate_beside_a_url(self, tiny: QwenVisionModel) -> None:
        buffer = io.BytesIO()
        first, *rest = _frames(4)
        first.save(buffer, "GIF", save_all=True, append_images=rest, duration=100)
        url = "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()
        pre = tiny.preprocess([{"url": url, "fps": 10}], "video")
        assert pre.video_timing == (video_timing(4, 2, fps=10),)

    def test_video_file_times_come_from_the_decoder(
        self, tiny: QwenVisionModel, tmp_path: Path
    ) -> None:
        av = pytest.importorskip("av")
        path = tmp_path / "clip.mp4"
        with av.open(str(path), "w") as container:
            stream = container.add_stream("mpeg4", rate=10)
            stream.width, stream.height = 64, 48
            stream.pix_fmt = "yuv420p"
            for number in range(30):  # 3 s at 10 fps
                pixels = np.full((48, 64, 3), number * 8, dtype=np.uint8)
                frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        pre = tiny.preprocess([str(path)], "video")
        assert pre.video_timing is not None
        (timing,) = pre.video_timing
        # Sampled at 2 frames per second: frames at 0, 0.5, ... 2.5 s.
        assert timing.fps == pytest.approx(2.0)
        assert list(timing.timestamps) == pytest.approx([0.25, 1.25, 2.25])
        assert pre.grid[0][0] == 3

    def test_images_have_no_timing(self, tiny: QwenVisionModel) -> None:
        assert tiny.preprocess([make_image(56, 56)], "image").video_timing is None

    @pytest.mark.parametrize(
        ("item", "message"),
        [
            ({"frames": [], "fps": -1}, r"mm_items\[0\]\.fps must be a positive number"),
            ({"frames": [], "fps": True}, r"mm_items\[0\]\.fps"),
            ({"frames": "x"}, r"mm_items\[0\]\.frames must be a list"),
            ({"frames": [], "rate": 2}, r"unknown key 'rate'"),
        ],
    )
    def test_bad_rates_name_the_item(
        self, tiny: QwenVisionModel, item: dict[str, object], message: str
    ) -> None:
        with pytest.raises(BadRequestError, match=message):
            tiny.preprocess([item], "video")


class TestChecks:
    def _good(self) -> tuple[VideoTiming, ...]:
        return (video_timing(4, 2, fps=2.0), video_timing(3, 2, fps=4.0))

    def test_consistent_timing_passes(self) -> None:
        check_video_timing(
            self._good(), modality="video", grid=[(2, 4, 4), (2, 4, 4)], where="here"
        )
        check_video_timing(None, modality="image", grid=[(1, 4, 4)], where="here")

    @pytest.mark.parametrize(
        ("timings", "modality", "grid", "message"),
        [
            (None, "video", [], None),
            ("good", "image", [(2, 4, 4), (2, 4, 4)], "video_timing on a image part"),
            ("good", "video", [(2, 4, 4)], "2 entries for 1 items"),
            ("good", "video", [(3, 4, 4), (2, 4, 4)], r"2 timestamps, but the item's grid"),
            (
                (VideoTiming(fps=3.0, second_per_grid_ts=0.5, timestamps=(0.0,)),),
                "video",
                [(1, 4, 4)],
                "not a whole number of frames",
            ),
            (
                (VideoTiming(fps=2.0, second_per_grid_ts=1.0, timestamps=(1.0, 0.0)),),
                "video",
                [(2, 4, 4)],
                "go backwards",
            ),
            (
                (VideoTiming(fps=0.0, second_per_grid_ts=1.0, timestamps=(0.0,)),),
                "video",
                [(1, 4, 4)],
                "positive",
            ),
        ],
    )
    def test_inconsistent_timing_is_refused(
        self, timings: object, modality: str, grid: list[tuple[int, ...]], message: str | None
    ) -> None:
        chosen = self._good() if timings == "good" else timings
        if message is None:
            check_video_timing(chosen, modality=modality, grid=grid, where="here")  # type: ignore[arg-type]
            return
        with pytest.raises(BadRequestError, match=message):
            check_video_timing(chosen, modality=modality, grid=grid, where="here")  # type: ignore[arg-type]

    def test_wire_round_trip_and_strictness(self) -> None:
        timings = self._good()
        assert timing_from_wire(timing_to_wire(timings)) == timings
        wire = timing_to_wire(timings)
        for bad in (
            {"fps": 2.0, "second_per_grid_ts": 1.0},
            {**wire[0], "extra": 1},
            {**wire[0], "fps": True},
            {**wire[0], "fps": float("nan")},
            {**wire[0], "timestamps": "0"},
        ):
            with pytest.raises(BadRequestError, match=r"video_timing\[0\]"):
                timing_from_wire([bad])
        with pytest.raises(BadRequestError, match="must be a list"):
            timing_from_wire({"fps": 2.0})
