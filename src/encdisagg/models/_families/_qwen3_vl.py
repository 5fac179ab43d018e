"""Qwen3-VL vision towers (dense ``qwen3_vl`` and MoE ``qwen3_vl_moe``) behind ``VisionModel``.

The tower returns the merged embedding *and* one deepstack feature map per deepstack layer,
each ``[tokens, out_hidden_size]``; the language model adds the deepstack maps to its hidden
states at the media tokens after its first decoder layers. ``forward`` concatenates them
along the hidden axis into one ``[tokens, out_hidden_size * (1 + N)]`` tensor, so rows still
belong to tokens: splitting per item, the prefix and global caches and every transport carry
it unchanged, and :attr:`Qwen3VisionModel.embedding_layout` names the column sections (the
wire header's ``layout``; the receiver hands each one out as a view). SGLang's Qwen3-VL encoder
lays its output out the same way (main embedding first, then the maps in layer order).

Images go through ``Qwen2VLImageProcessorPil`` with the checkpoint's settings (transformers
maps ``qwen3_vl`` to it; the default class needs torchvision). ``Qwen3VLVideoProcessor``
needs torchvision too, so a video is built the way it builds one: the frame size comes from
its own ``smart_resize`` (a pixel budget over the whole clip, not per frame), every frame is
resized to it, rescaled, normalised and patchified by the image processor, and consecutive
frames are paired along the temporal axis (the last one repeated to fill the final pair).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, final

import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as _video_resize

from ..._errors import BadRequestError, InternalError
from ...transfer import EmbeddingLayout, deepstack_layout
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
    from transformers import PreTrainedModel

__all__ = ["QWEN3_VIDEO_MAX_PIXELS", "QWEN3_VIDEO_MIN_PIXELS", "Qwen3VisionModel"]

#: Qwen3VLVideoProcessor's ``size`` defaults: the pixels of the whole clip (frames x height x
#: width) after resizing lie between these (32 = patch 16 x merge 2).
QWEN3_VIDEO_MIN_PIXELS: Final = 128 * 32 * 32
QWEN3_VIDEO_MAX_PIXELS: Final = 768 * 32 * 32
SUPPORTED_VISION_TYPES: Final = ("qwen3_vl_vision", "qwen3_vl_moe_vision")


@final
class Qwen3VisionModel(QwenTower):
    """A Qwen3-VL (dense or MoE) vision tower with its processor.

    Build one with :func:`~encdisagg.models.load_model`; the constructor takes the parts.
    ``preprocess`` is safe from several threads at once; ``forward`` one thread at a time.

    :param tower: a ``Qwen3VLVisionModel`` or ``Qwen3VLMoeVisionModel`` on its device and dtype.
    :param image_processor: the image processor whose settings fix the token counts.
    :param name: the built-in name or checkpoint folder.
    :param media: which media items are accepted and from where.
    :param video_min_pixels: fewest pixels of a whole video clip after resizing.
    :param video_max_pixels: most pixels of a whole video clip after resizing.
    :param limits: the default media budgets.
    :param preprocess: ``"fast"`` or ``"reference"`` (the image processor itself).
    :raises BadRequestError: naming ``model`` for another tower or mismatched patch sizes,
        ``preprocess`` for another mode.
    """

    def __init__(
        self,
        tower: PreTrainedModel,
        image_processor: Qwen2VLImageProcessorPil,
        *,
        name: str,
        media: MediaPolicy | None = None,
        video_min_pixels: int = QWEN3_VIDEO_MIN_PIXELS,
        video_max_pixels: int = QWEN3_VIDEO_MAX_PIXELS,
        limits: MediaLimits | None = None,
        preprocess: str = "fast",
    ) -> None:
        config: Any = tower.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_VISION_TYPES:
            raise BadRequestError(
                f"model: {name!r} is a {model_type!r} model; supported vision towers are "
                f"{', '.join(SUPPORTED_VISION_TYPES)}"
            )
        check_shared_settings(image_processor, config, name)
        module: torch.nn.Module = tower
        module.train(False)
        self._tower = tower
        self._weights = tower
        self._name = name
        self._model_type: str = model_type
        self._token_width = int(config.out_hidden_size)
        self._layout = deepstack_layout(self._token_width, len(config.deepstack_visual_indexes))
        self._media = media or MediaPolicy()
        self._limits = limits or MediaLimits()
        self._processor_config: dict[str, Any] = image_processor.to_dict()
        self._merge_size = int(image_processor.merge_size)
        self._patch_size = int(image_processor.patch_size)
        self._temporal = int(image_processor.temporal_patch_size)
        self._video_pixels = (video_min_pixels, video_max_pixels)
        factor = self._patch_size * self._merge_size
        size = image_processor.size
        self._image_rule = ResizeRule(factor, int(size["shortest_edge"]), int(size["longest_edge"]))
        # The budget prices each frame before the clip's length is known; the frames of the
        # shortest clip (one temporal patch) share the clip's pixels, so no frame gets more.
        self._video_rule = ResizeRule(
            factor, factor * factor, max(factor * factor, video_max_pixels // self._temporal)
        )
        processor_config = dict(self._processor_config)
        self._processors = PerThread(
            image_processor, lambda: Qwen2VLImageProcessorPil.from_dict(dict(processor_config))
        )
        self._pixels = fast_pixels(image_processor, preprocess)
        self._identity = identity_digest(
            model_type,
            self.preprocess_mode,  # the paths' pixel values differ slightly
            architecture_json(config.to_dict()),
            settings_json(self._processor_config),
            json.dumps(self._video_pixels),
            state_digest(tower),
        )

    # --- identity and shape -------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        """Width of the joint embedding: ``out_hidden_size * (1 + deepstack layers)``."""
        return self._layout.width

    @property
    def token_width(self) -> int:
        """Width of each section: the merger's output, the language model's hidden size."""
        return self._token_width

    @property
    def deepstack_layers(self) -> int:
        """How many deepstack feature maps follow the main embedding."""
        return len(self._layout.sections) - 1

    @property
    def embedding_layout(self) -> EmbeddingLayout:
        """The column sections of every embedding: ``embedding``, ``deepstack_0``, ..."""
        return self._layout

    def __repr__(self) -> str:
        return (
            f"Qwen3VisionModel(name={self._name!r}, type={self._model_type!r}, "
            f"hidden_size={self.hidden_size}, deepstack_layers={self.deepstack_layers}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    # --- preprocessing ------------------------------------------------------------------

    def video_frame_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` every frame of a ``frames``-frame clip is resized to: the rule of
        ``Qwen3VLVideoProcessor`` (its pixel budget covers the whole clip). Does not block.

        :raises ValueError: for an aspect ratio above 200.
        """
        low, high = self._video_pixels
        # The processor sizes the frames of the clip as decoded (it pads to whole temporal
        # patches afterwards) and refuses a clip shorter than one temporal patch; such a clip
        # is sized here as the padded one it becomes.
        resized: tuple[int, int] = _video_resize(
            max(frames, self._temporal),
            height,
            width,
            temporal_factor=self._temporal,
            factor=self._patch_size * self._merge_size,
            min_pixels=low,
            max_pixels=high,
        )
        return resized

    def _video_patches(
        self, processor: Qwen2VLImageProcessorPil, frames: list[Image.Image], index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        label = item_label(index)
        check_frame_sizes(frames, label)
        width, height = frames[0].size
        try:
            height, width = self.video_frame_size(len(frames), height, width)
        except ValueError as exc:
            raise BadRequestError(f"{label}: cannot preprocess video: {exc}") from exc
        if self._pixels is not None:
            return fast_clip(self._pixels, frames, height, width)
        # One size for the whole clip (its pixel budget), applied before the processor.
        values, grid = paired_frames(
            processor, frames, label, resize_to=(width, height), do_resize=False
        )
        return values, grid, None

    # --- forward ------------------------------------------------------------------------

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        """Encode a batch in one fused tower call; one ``[tokens, hidden_size]`` tensor per
        element (the main embedding, then each deepstack map: :attr:`embedding_layout`), on
        :attr:`device` in :attr:`dtype`. Blocks on the tower's compute.

        :raises InternalError: if an element lacks this model's features, or the tower
            produced other token counts or widths than expected.
        """
        if not batch:
            return []
        totals, pixel_values, grids = gather_features(batch, (PIXEL_VALUES, GRID_THW), self._name)
        if not grids:
            return [empty_embedding(self.hidden_size, self.dtype, self.device) for _ in batch]
        with torch.inference_mode():
            output = self._tower(
                torch.cat(pixel_values).to(self.device, self.dtype),
                grid_thw=torch.cat(grids).to(self.device),
            )
            sections = [output.pooler_output, *(output.deepstack_features or ())]
            if len(sections) != len(self._layout.sections) or any(
                section.dim() != 2 or section.shape[1] != self._token_width for section in sections
            ):
                shapes = [list(section.shape) for section in sections]
                raise InternalError(
                    f"Encoder produced sections of shapes {shapes}, expected "
                    f"{len(self._layout.sections)} of width {self._token_width}"
                )
            rows = torch.cat(sections, dim=1)
        # Split and cloned outside inference mode: ordinary tensors with their own storage.
        return owned_pieces(rows, totals)

    # --- checkpoints --------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path) -> None:
        """Write a checkpoint folder :func:`~encdisagg.models.load_model` loads back
        bit-identically: the tower's ``config.json`` and ``model.safetensors``, the image
        processor's ``preprocessor_config.json`` and ``video_preprocessor_config.json``
        with the clip pixel limits. Blocks on disk I/O.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tower.save_pretrained(folder)
        Qwen2VLImageProcessorPil.from_dict(dict(self._processor_config)).save_pretrained(folder)
        video = {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"shortest_edge": self._video_pixels[0], "longest_edge": self._video_pixels[1]},
            "patch_size": self._patch_size,
            "temporal_patch_size": self._temporal,
            "merge_size": self._merge_size,
        }
        (folder / VIDEO_CONFIG_NAME).write_text(json.dumps(video, indent=2) + "\n")
