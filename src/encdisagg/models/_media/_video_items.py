"""A video item's own frame rate: ``{"url": ..., "fps": 4}`` or ``{"frames": [...], "fps": 4}``.

SGLang's ``mm_items`` carry per-item processor options beside ``url`` and ``content_hash``;
for videos the one that matters to the LLM is the frame rate, which fixes the timing of each
temporal patch (:mod:`encdisagg._video_timing`). A list of frames has nowhere to say its
rate, so it may come wrapped as ``{"frames": [...], "fps": ...}``. Without one the rate is the
processor default (2 frames per second).
"""

from __future__ import annotations

import math
from typing import Final

from ..._errors import BadRequestError
from ._policy import item_label

__all__ = ["video_source"]

_FRAMES_KEYS: Final = frozenset({"frames", "fps"})


def video_source(item: object, index: int) -> tuple[object, float | None]:
    """``(what load_video decodes, the item's fps or None)``. Does not block.

    :raises BadRequestError: naming ``mm_items[index]`` for an fps that is not a positive
        number, or a ``frames`` map with other keys or without a list of frames.
    """
    if not isinstance(item, dict) or ("fps" not in item and "frames" not in item):
        return item, None
    label = item_label(index)
    fps = item.get("fps")
    if fps is not None and (type(fps) not in (int, float) or not math.isfinite(fps) or fps <= 0):
        raise BadRequestError(f"{label}.fps must be a positive number; got {fps!r}")
    rate = None if fps is None else float(fps)
    if "frames" in item:
        unknown = sorted(str(key) for key in item if key not in _FRAMES_KEYS)
        if unknown:
            raise BadRequestError(f"{label}: unknown key {unknown[0]!r} beside frames")
        frames = item["frames"]
        if not isinstance(frames, (list, tuple)):
            raise BadRequestError(f"{label}.frames must be a list of frames")
        return frames, rate
    return {key: value for key, value in item.items() if key != "fps"}, rate
