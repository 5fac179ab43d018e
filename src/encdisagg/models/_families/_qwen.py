"""Qwen2-VL family vision towers behind the ``VisionModel`` protocol.

Images go through transformers' ``Qwen2VLImageProcessorPil`` (the processor Qwen2-VL and
Qwen2.5-VL share; the default ``Qwen2VLImageProcessor`` needs torchvision). transformers'
``Qwen2VLVideoProcessor`` needs torchvision too, so videos are built from the image processor:
every frame is resized, rescaled, normalised and patchified by it at the video processor's
pixel limits, and consecutive frames are then paired along the temporal axis exactly as the
video processor lays out ``pixel_values_videos`` (``temporal_patch_size`` frames per temporal
patch, the last frame repeated to fill the final one). A video of ``F`` frames thus has the
grid ``(ceil(F / temporal_patch_size), h, w)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, final

from ..._errors import BadRequestError
from .._media._limits import ResizeRule
from .._media._policy import item_label
from ._qwen_tower import QwenTower
from ._qwen_video import check_frame_sizes, fast_clip, paired_frames

if TYPE_CHECKING:
    import torch
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

__all__ = ["QwenVisionModel", "VIDEO_MAX_PIXELS", "VIDEO_MIN_PIXELS"]

# Qwen2VLVideoProcessor's defaults: frames are resized to between 128 and 768 merged patches.
VIDEO_MIN_PIXELS: Final = 128 * 28 * 28
VIDEO_MAX_PIXELS: Final = 768 * 28 * 28

_OUTPUT_WIDTH_KEYS: Final = {
    "qwen2_vl_vision": "hidden_size",  # Qwen2-VL: the merger's output width
    "qwen2_5_vl_vision": "out_hidden_size",  # Qwen2.5-VL: hidden_size is the ViT width
}


@final
class QwenVisionModel(QwenTower):
    """A Qwen2-VL or Qwen2.5-VL vision tower with its processor.

    Build one with :func:`~encdisagg.models.load_model`; the constructor takes the parts.
    ``preprocess`` is safe to call from several threads at once (each thread gets its own
    processor); ``forward`` must be called by one thread at a time, any thread.

    :param tower: a ``Qwen2VisionTransformerPretrainedModel`` or
        ``Qwen2_5_VisionTransformerPretrainedModel``, already on its device and dtype.
    :param image_processor: the image processor whose settings fix the token counts.
    :param name: the model's name (a built-in name or the checkpoint folder).
    :param media: which media items may be and where they may come from.
    :param video_min_pixels: fewest pixels a video frame is resized to (default
        :data:`VIDEO_MIN_PIXELS`).
    :param video_max_pixels: most pixels a video frame is resized to (default
        :data:`VIDEO_MAX_PIXELS`).
    :param limits: the media budgets of a request whose caller passes none (defaults:
        :class:`~.._media._limits.MediaLimits`).
    :param preprocess: ``"fast"`` (``uint8`` resize, one normalising pass; see
        :mod:`~._fast_pixels`), ``"device"`` (the same on the tower's device) or
        ``"reference"`` (the image processor itself).
    :raises BadRequestError: naming ``model`` if ``tower`` is no supported vision tower or the
        processor's patch sizes do not match the tower's; ``preprocess`` for another mode.
    """

    _SUPPORTED = tuple(_OUTPUT_WIDTH_KEYS)
    _VIDEO_PROCESSOR = "Qwen2VLVideoProcessor"
    _VIDEO_PIXELS = (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    _SHOWN = (("type", "_model_type"), ("hidden_size", "_hidden_size"))

    def _configure(self, config: Any) -> None:
        self._hidden_size = int(getattr(config, _OUTPUT_WIDTH_KEYS[self._model_type]))
        self._video_rule = ResizeRule(self._factor, *self._video_pixels)

    def _video_patches(
        self, processor: Qwen2VLImageProcessorPil, frames: list[Image.Image], index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        label = item_label(index)
        check_frame_sizes(frames, label)
        if self._pixels is not None:
            width, height = frames[0].size
            try:
                height, width = self._video_rule.resized(width, height)
            except ValueError as exc:
                raise BadRequestError(f"{label}: cannot preprocess video: {exc}") from exc
            return fast_clip(self._pixels, frames, height, width)
        # Each frame sized on its own, within the video processor's per-frame pixel limits.
        return (*paired_frames(processor, frames, label, size=self._video_size()), None)

    def _rows(self, output: Any) -> torch.Tensor:
        rows: torch.Tensor = output.pooler_output
        return rows
