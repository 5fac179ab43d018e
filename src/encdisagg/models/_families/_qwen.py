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

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, final

import torch
from transformers import Qwen2VLImageProcessorPil

from ..._errors import BadRequestError
from ._fast_pixels import fast_pixels
from .._media._policy import MediaPolicy, item_label
from .._media._limits import MediaLimits, ResizeRule
from .._protocol import Preprocessed
from ._qwen_tower import QwenTower
from ._qwen_video import (
    GRID_THW,
    PIXEL_VALUES,
    VIDEO_CONFIG_NAME,
    check_frame_sizes,
    check_shared_settings,
    fast_clip,
    paired_frames,
)
from ._tower import (
    PerThread,
    architecture_json,
    empty_embedding,
    gather_features,
    identity_digest,
    owned_pieces,
    settings_json,
    state_digest,
)

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedModel

__all__ = ["QwenVisionModel", "VIDEO_MAX_PIXELS", "VIDEO_MIN_PIXELS"]

# Qwen2VLVideoProcessor's defaults: frames are resized to between 128 and 768 merged patches.
VIDEO_MIN_PIXELS: Final = 128 * 28 * 28
VIDEO_MAX_PIXELS: Final = 768 * 28 * 28

_OUTPUT_WIDTH_KEYS: Final = {
    "qwen2_vl_vision": "hidden_size",  # Qwen2-VL: the merger's output width
    "qwen2_5_vl_vision": "out_hidden_size",  # Qwen2.5-VL: hidden_size is the ViT width
}
SUPPORTED_VISION_TYPES: Final = tuple(_OUTPUT_WIDTH_KEYS)


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
    :param video_min_pixels: fewest pixels a video frame is resized to.
    :param video_max_pixels: most pixels a video frame is resized to.
    :param limits: the media budgets of a request whose caller passes none (defaults:
        :class:`~._media_limits.MediaLimits`).
    :param preprocess: ``"fast"`` (``uint8`` resize, one normalising pass; see
        :mod:`~._fast_pixels`) or ``"reference"`` (the image processor itself).
    :raises BadRequestError: naming ``model`` if ``tower`` is no supported vision tower or the
        processor's patch sizes do not match the tower's; ``preprocess`` for another mode.
    """

    def __init__(
        self,
        tower: PreTrainedModel,
        image_processor: Qwen2VLImageProcessorPil,
        *,
        name: str,
        media: MediaPolicy | None = None,
        video_min_pixels: int = VIDEO_MIN_PIXELS,
        video_max_pixels: int = VIDEO_MAX_PIXELS,
        limits: MediaLimits | None = None,
        preprocess: str = "fast",
    ) -> None:
        model_type = getattr(tower.config, "model_type", None)
        if model_type not in _OUTPUT_WIDTH_KEYS:
            raise BadRequestError(
                f"model: {name!r} is a {model_type!r} model; supported vision towers are "
                f"{', '.join(SUPPORTED_VISION_TYPES)}"
            )
        check_shared_settings(image_processor, tower.config, name)
        module: torch.nn.Module = tower
        module.train(False)  # eval mode; via the base class, whose annotations mypy sees
        self._tower = tower
        self._weights = tower
        self._name = name
        self._model_type: str = model_type
        self._hidden_size = int(getattr(tower.config, _OUTPUT_WIDTH_KEYS[model_type]))
        self._media = media or MediaPolicy()
        self._processor_config: dict[str, Any] = image_processor.to_dict()
        self._merge_size = int(image_processor.merge_size)
        self._temporal = int(image_processor.temporal_patch_size)
        self._video_size = {"shortest_edge": video_min_pixels, "longest_edge": video_max_pixels}
        self._limits = limits or MediaLimits()
        factor = int(image_processor.patch_size) * self._merge_size
        size = image_processor.size
        self._image_rule = ResizeRule(factor, int(size["shortest_edge"]), int(size["longest_edge"]))
        self._video_rule = ResizeRule(factor, video_min_pixels, video_max_pixels)
        config = dict(self._processor_config)
        self._processors = PerThread(
            image_processor, lambda: Qwen2VLImageProcessorPil.from_dict(dict(config))
        )
        self._pixels = fast_pixels(image_processor, preprocess)
        self._identity = identity_digest(
            model_type,
            # The two paths' pixel values differ slightly, so their embeddings never share
            # a cache entry.
            self.preprocess_mode,
            architecture_json(tower.config.to_dict()),
            settings_json(self._processor_config),
            json.dumps(self._video_size, sort_keys=True),
            state_digest(tower),
        )

    # --- identity and shape -------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        """Width of the embeddings: the merger's output width, the LLM's hidden size."""
        return self._hidden_size

    def __repr__(self) -> str:
        return (
            f"QwenVisionModel(name={self._name!r}, type={self._model_type!r}, "
            f"hidden_size={self._hidden_size}, dtype={self.dtype}, device={self.device})"
        )

    # --- preprocessing ------------------------------------------------------------------

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
        return (*paired_frames(processor, frames, label, size=self._video_size), None)

    # --- forward ------------------------------------------------------------------------

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        """Encode a batch in one fused tower call; one ``[tokens, hidden_size]`` tensor per
        element, on :attr:`device` in :attr:`dtype`. Blocks on the tower's compute.

        :raises InternalError: if an element lacks this model's features, or the tower
            produced a different number of tokens than the elements' ``token_counts``.
        """
        if not batch:
            return []
        totals, pixel_values, grids = gather_features(batch, (PIXEL_VALUES, GRID_THW), self._name)
        if not grids:
            return [empty_embedding(self._hidden_size, self.dtype, self.device) for _ in batch]
        with torch.inference_mode():
            output = self._tower(
                torch.cat(pixel_values).to(self.device, self.dtype),
                grid_thw=torch.cat(grids).to(self.device),
            )
            rows: torch.Tensor = output.pooler_output
        # Split and cloned outside inference mode: ordinary tensors with their own storage.
        return owned_pieces(rows, totals, self._hidden_size)

    # --- checkpoints --------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path) -> None:
        """Write a checkpoint folder :func:`~encdisagg.models.load_model` loads back
        bit-identically: ``config.json`` and ``model.safetensors`` of the tower,
        ``preprocessor_config.json`` of the image processor and
        ``video_preprocessor_config.json`` with the video pixel limits. Blocks on disk I/O.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tower.save_pretrained(folder)
        Qwen2VLImageProcessorPil.from_dict(dict(self._processor_config)).save_pretrained(folder)
        video = {
            "video_processor_type": "Qwen2VLVideoProcessor",
            "size": self._video_size,
            "patch_size": self._processor_config.get("patch_size"),
            "temporal_patch_size": self._processor_config.get("temporal_patch_size"),
            "merge_size": self._merge_size,
        }
        (folder / VIDEO_CONFIG_NAME).write_text(json.dumps(video, indent=2) + "\n")
