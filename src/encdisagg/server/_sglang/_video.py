"""Which of SGLang's video fields a model's parts carry, and their values.

SGLang's receivers hand a video part's timing to the model's processor through two
auxiliary fields of the header: ``video_timestamps`` (the Qwen3-VL family writes a
``<t seconds>`` stamp before each temporal step) and ``second_per_grid_ts`` (the Qwen2.5-VL
family's rotary time step). SGLang's encoder fills the one its model uses and leaves the
other ``None``; so do we, from the timing our Encoder computed for each video item.
"""

from __future__ import annotations

from typing import Final, Literal

from ..._video_timing import VideoTiming

__all__ = ["VideoFields", "video_aux", "video_fields"]

VideoFields = Literal["timestamps", "second_per_grid"]

#: Model types whose processor takes per-step timestamps.
_TIMESTAMP_TYPES: Final = frozenset(
    {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "intern_s2_preview", "cosmos3_omni"}
)
#: Model types whose processor takes seconds per temporal grid step.
_SECONDS_TYPES: Final = frozenset({"qwen2_5_vl", "qwen2_5_omni", "qwen3_omni_moe"})


def video_fields(model_type: str | None) -> VideoFields | None:
    """Which field a model of ``model_type`` reads its video timing from. Not async."""
    if model_type in _TIMESTAMP_TYPES:
        return "timestamps"
    if model_type in _SECONDS_TYPES:
        return "second_per_grid"
    return None


def video_aux(
    fields: VideoFields | None, timing: tuple[VideoTiming, ...] | None
) -> tuple[tuple[tuple[float, ...], ...] | None, tuple[float, ...] | None]:
    """``(video_timestamps, second_per_grid_ts)`` of a part with ``timing`` (one per video
    item): the one field the model reads filled, the other ``None``. Not async."""
    if fields is None or not timing:
        return None, None
    if fields == "timestamps":
        return tuple(item.timestamps for item in timing), None
    return None, tuple(item.second_per_grid_ts for item in timing)
