"""Video timing: when each temporal patch of a video happens, as the models' processors say.

The LLM side of a video model needs to know *when* each temporal grid step is, not only how
many there are: Qwen2.5-VL's rotary time positions advance by ``second_per_grid_ts`` per
temporal patch, and Qwen3-VL writes a ``<t seconds>`` timestamp before each one. The encoder
knows the frames it sampled; this module turns them into those values exactly as
transformers' processors do, and carries them in the embedding header and the ``/encode``
answer, one :class:`VideoTiming` per video item.

- ``second_per_grid_ts = temporal_patch_size / fps`` (``Qwen2_5_VLProcessor``), where ``fps``
  is the rate of the frames the model saw (``VideoMetadata.sampled_fps``).
- ``timestamps``: the frames' times in seconds (frame index / source fps), the list padded
  with its last entry to a multiple of ``temporal_patch_size``, then each group's first and
  last times averaged (``Qwen3VLProcessor._calculate_timestamps``): one per temporal patch.

Pure values and arithmetic, no I/O; free of torch so every layer may import it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from ._errors import BadRequestError
from ._numbers import real

__all__ = [
    "DEFAULT_VIDEO_FPS",
    "VideoTiming",
    "check_video_timing",
    "frame_timestamps",
    "second_per_grid",
    "timing_from_wire",
    "timing_to_wire",
    "video_timing",
]

#: Frames per second assumed for frames sent without a rate: the Qwen video processors' and
#: SGLang's encoder default.
DEFAULT_VIDEO_FPS: Final = 2.0
#: Relative slack when a receiver compares timing with the grid (floats crossed msgpack/JSON
#: exactly, but a peer may have computed them in another order).
_TOLERANCE: Final = 1e-6
_KEYS: Final = frozenset({"fps", "second_per_grid_ts", "timestamps"})


@dataclass(frozen=True, slots=True)
class VideoTiming:
    """The timing of one video item.

    :param fps: frames per second of the frames the model saw.
    :param second_per_grid_ts: seconds per temporal grid step (Qwen2.5-VL's value).
    :param timestamps: the time in seconds of each temporal grid step (Qwen3-VL's values);
        one per step, so ``len(timestamps)`` is the item's grid ``t``.
    """

    fps: float
    second_per_grid_ts: float
    timestamps: tuple[float, ...]


def second_per_grid(temporal_patch_size: int, fps: float) -> float:
    """Seconds per temporal patch: ``temporal_patch_size / fps``, as Qwen2.5-VL computes it.

    :raises ValueError: for a non-positive patch size or rate.
    """
    if temporal_patch_size < 1 or not fps > 0:
        raise ValueError(
            f"need temporal_patch_size >= 1 and fps > 0; got {temporal_patch_size}, {fps}"
        )
    return temporal_patch_size / fps


def frame_timestamps(frame_times: Sequence[float], temporal_patch_size: int) -> tuple[float, ...]:
    """One time per temporal patch from the frames' times, as Qwen3-VL computes it: pad with
    the last frame's time to a multiple of ``temporal_patch_size``, then average each group's
    first and last times.

    :raises ValueError: for no frames or a non-positive patch size.
    """
    if not frame_times or temporal_patch_size < 1:
        raise ValueError("need at least one frame and temporal_patch_size >= 1")
    times = [float(t) for t in frame_times]
    times.extend([times[-1]] * (-len(times) % temporal_patch_size))
    last = temporal_patch_size - 1
    return tuple(
        (times[i] + times[i + last]) / 2 for i in range(0, len(times), temporal_patch_size)
    )


def video_timing(
    frame_count: int,
    temporal_patch_size: int,
    *,
    fps: float | None = None,
    frame_times: Sequence[float] | None = None,
) -> VideoTiming:
    """The timing of a video of ``frame_count`` sampled frames.

    ``frame_times`` (seconds, one per frame) are the times the frames were taken at, when
    the decoder knows them; otherwise the frames are taken to be ``fps`` apart
    (:data:`DEFAULT_VIDEO_FPS` when ``None``), the first at 0. With known times, the rate is
    the one they were sampled at: ``(frames - 1) / (last - first)``, or ``fps`` (its
    default) for a single frame.

    :raises ValueError: for no frames, a non-positive rate, or times that do not match the
        frames or go backwards.
    """
    if frame_count < 1:
        raise ValueError("a video needs at least one frame")
    rate = real("fps", DEFAULT_VIDEO_FPS if fps is None else float(fps), above=0)
    if frame_times is None:
        times = [index / rate for index in range(frame_count)]
    else:
        times = [float(t) for t in frame_times]
        if len(times) != frame_count:
            raise ValueError(f"{len(times)} frame times for {frame_count} frames")
        if any(later < earlier for earlier, later in itertools.pairwise(times)):
            raise ValueError("frame times must not go backwards")
        if frame_count > 1 and times[-1] > times[0]:
            rate = (frame_count - 1) / (times[-1] - times[0])
    return VideoTiming(
        fps=rate,
        second_per_grid_ts=second_per_grid(temporal_patch_size, rate),
        timestamps=frame_timestamps(times, temporal_patch_size),
    )


# --- on the wire --------------------------------------------------------------------------


def timing_to_wire(timings: Sequence[VideoTiming]) -> list[dict[str, Any]]:
    """The header / ``/encode`` answer value: one map per video item."""
    return [
        {
            "fps": timing.fps,
            "second_per_grid_ts": timing.second_per_grid_ts,
            "timestamps": list(timing.timestamps),
        }
        for timing in timings
    ]


def _number(field: str, value: object) -> float:
    # msgpack/JSON give ints for whole floats.
    return float(real(field, value, error=BadRequestError))


def timing_from_wire(value: object, *, field: str = "video_timing") -> tuple[VideoTiming, ...]:
    """Parse the wire value (a list of maps with exactly ``fps``, ``second_per_grid_ts``
    and ``timestamps``) into plain values.

    :raises BadRequestError: naming ``field`` (and the item) for anything else.
    """
    if not isinstance(value, (list, tuple)):
        raise BadRequestError(f"{field} must be a list of timing maps; got {value!r}")
    timings = []
    for index, item in enumerate(value):
        where = f"{field}[{index}]"
        if not isinstance(item, dict) or set(item) != _KEYS:
            raise BadRequestError(
                f"{where} must be a map of exactly {', '.join(sorted(_KEYS))}; got {item!r}"
            )
        stamps = item["timestamps"]
        if not isinstance(stamps, (list, tuple)):
            raise BadRequestError(f"{where}.timestamps must be a list of numbers")
        timings.append(
            VideoTiming(
                fps=_number(f"{where}.fps", item["fps"]),
                second_per_grid_ts=_number(
                    f"{where}.second_per_grid_ts", item["second_per_grid_ts"]
                ),
                timestamps=tuple(_number(f"{where}.timestamps", t) for t in stamps),
            )
        )
    return tuple(timings)


def check_video_timing(
    timings: Sequence[VideoTiming] | None,
    *,
    modality: str,
    grid: Sequence[Sequence[int]],
    where: str,
    req_id: str | None = None,
) -> None:
    """Refuse timing that cannot belong to these items: timing on a part that is not video,
    not one entry per item, a rate or step that is not positive, a step that is not a whole
    number of frames (``second_per_grid_ts * fps``), timestamps that do not number the
    item's temporal grid steps or go backwards. Video parts may come without timing (older
    encoders, and error parts). Does not block.

    :raises BadRequestError: naming ``where`` and the first inconsistency.
    """
    if timings is None:
        return
    if modality != "video":
        raise BadRequestError(f"{where}: video_timing on a {modality} part", req_id=req_id)
    if len(timings) != len(grid):
        raise BadRequestError(
            f"{where}: video_timing has {len(timings)} entries for {len(grid)} items",
            req_id=req_id,
        )
    for index, (timing, row) in enumerate(zip(timings, grid, strict=True)):
        item = f"{where}: video_timing[{index}]"
        if not (timing.fps > 0 and timing.second_per_grid_ts > 0):
            raise BadRequestError(
                f"{item} needs a positive fps and second_per_grid_ts", req_id=req_id
            )
        frames = timing.second_per_grid_ts * timing.fps
        if abs(frames - round(frames)) > _TOLERANCE * max(1.0, frames) or round(frames) < 1:
            raise BadRequestError(
                f"{item}: second_per_grid_ts x fps is {frames:g}, not a whole number of frames "
                "per temporal patch",
                req_id=req_id,
            )
        steps = row[0] if len(row) == 3 else 1
        if len(timing.timestamps) != steps:
            raise BadRequestError(
                f"{item} has {len(timing.timestamps)} timestamps, but the item's grid "
                f"{list(row)} has {steps} temporal steps",
                req_id=req_id,
            )
        stamps = timing.timestamps
        if any(later < earlier for earlier, later in itertools.pairwise(stamps)):
            raise BadRequestError(f"{item}: timestamps go backwards", req_id=req_id)
