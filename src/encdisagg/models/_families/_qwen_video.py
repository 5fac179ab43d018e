"""What the Qwen2-VL and Qwen3-VL adapters share around their image processor: the
settings it must agree on with the tower, and videos built from it.

transformers' Qwen2-VL and Qwen3-VL video processors need torchvision, so every frame is
rescaled, normalised and patchified by the image processor instead, and consecutive frames
are then paired along the temporal axis exactly as the video processors lay out
``pixel_values_videos``: ``temporal_patch_size`` frames per temporal patch, the last frame
repeated to fill the final one. The families differ only in how a frame's size is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import torch
from PIL import Image

from ..._errors import BadRequestError

if TYPE_CHECKING:
    from transformers import Qwen2VLImageProcessorPil

    from ._fast_pixels import FastPixels

__all__ = [
    "FRAMES_PER_CALL",
    "GRID_THW",
    "PIXEL_VALUES",
    "VIDEO_CONFIG_NAME",
    "check_frame_sizes",
    "check_shared_settings",
    "fast_clip",
    "paired_frames",
]

#: The video processor settings a checkpoint folder carries next to the image processor's.
VIDEO_CONFIG_NAME: Final = "video_preprocessor_config.json"
#: Video frames handed to the image processor per call.
FRAMES_PER_CALL: Final = 8

# Keys of ``Preprocessed.features`` the Qwen vision models write and read.
PIXEL_VALUES: Final = "pixel_values"
GRID_THW: Final = "grid_thw"


# Processor setting -> tower config setting; they must agree or token counts are wrong.
_SHARED_SETTINGS: Final = {
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "merge_size": "spatial_merge_size",
}


def check_shared_settings(image_processor: object, tower_config: object, name: str) -> None:
    """:raises BadRequestError: naming ``model`` if the image processor's patch, temporal
    patch or merge size differs from the tower's."""
    for setting, tower_setting in _SHARED_SETTINGS.items():
        ours = getattr(image_processor, setting, None)
        theirs = getattr(tower_config, tower_setting, None)
        if ours != theirs:
            raise BadRequestError(
                f"model: {name!r} has a processor with {setting}={ours!r}, but its tower "
                f"has {tower_setting}={theirs!r}"
            )


def check_frame_sizes(frames: list[Image.Image], label: str) -> None:
    """:raises BadRequestError: naming ``label[i]`` for a frame of another size than the
    first."""
    first = frames[0].size
    for number, frame in enumerate(frames):
        if frame.size != first:
            raise BadRequestError(
                f"{label}[{number}]: frame is {frame.size[0]}x{frame.size[1]}, but the "
                f"video's first frame is {first[0]}x{first[1]}"
            )


def paired_frames(
    processor: Qwen2VLImageProcessorPil,
    frames: list[Image.Image],
    label: str,
    *,
    resize_to: tuple[int, int] | None = None,
    **call: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A video's ``pixel_values`` rows and its ``(1, 3)`` grid ``(t, h, w)``. Blocks on the
    processor's CPU work.

    :param resize_to: ``(width, height)`` every frame is resized to (bicubic) before the
        processor sees it; ``None`` leaves the sizing to the processor.
    :param call: keywords of each processor call (its ``size``, or ``do_resize=False``).
    :raises BadRequestError: naming ``label`` for frames the processor refuses.
    """
    temporal = int(processor.temporal_patch_size)
    patch = int(processor.patch_size)
    frame_count = len(frames)
    grid_h = grid_w = channels = 0
    kept: list[torch.Tensor] = []
    # A few frames per processor call: its float copies of a whole long video at once
    # would cost several times the memory of the result (each frame is independent).
    for start in range(0, frame_count, FRAMES_PER_CALL):
        chunk = frames[start : start + FRAMES_PER_CALL]
        if resize_to is not None:
            chunk = [frame.resize(resize_to, Image.Resampling.BICUBIC) for frame in chunk]
        try:
            out = processor(images=chunk, return_tensors="pt", **call)
        except (ValueError, TypeError) as exc:
            raise BadRequestError(f"{label}: cannot preprocess video: {exc}") from exc
        per_frame: torch.Tensor = out[PIXEL_VALUES]
        _, grid_h, grid_w = (int(size) for size in out["image_grid_thw"][0].tolist())
        channels = per_frame.shape[1] // (temporal * patch * patch)
        # The image processor repeats each frame over the temporal slots of its patch;
        # keep one slot per frame: [frames, patches, channels, patch*patch].
        shaped = per_frame.view(len(chunk), grid_h * grid_w, channels, temporal, patch * patch)
        kept.append(shaped[:, :, :, 0].contiguous())
        del out, per_frame, shaped
    patches = grid_h * grid_w
    single = torch.cat(kept) if len(kept) > 1 else kept[0]
    del kept
    if pad := -frame_count % temporal:
        single = torch.cat([single, single[-1:].expand(pad, -1, -1, -1)])
    grid_t = single.shape[0] // temporal
    # [t, temporal, patches, C, P] -> [t, patches, C, temporal, P]: the video processor's
    # order (channel, then time, then the pixels of the patch) in each flattened row.
    stacked = single.view(grid_t, temporal, patches, channels, patch * patch)
    values = stacked.permute(0, 2, 3, 1, 4).reshape(grid_t * patches, -1).contiguous()
    return values, torch.tensor([[grid_t, grid_h, grid_w]], dtype=torch.int64)


def fast_clip(
    pixels: FastPixels, frames: list[Image.Image], height: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`paired_frames` on the fast path, with the resized ``uint8`` frames; on
    ``pixels.device``. Blocks on CPU work."""
    values, clip = pixels.qwen_video(frames, height, width)
    grid_t = -(-len(frames) // pixels.temporal)
    patch = pixels.patch_size
    grid = torch.tensor([[grid_t, height // patch, width // patch]], dtype=torch.int64)
    return values, grid, clip
