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
from typing import TYPE_CHECKING, Any, Final, final

import torch
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as _video_resize

from ..._errors import BadRequestError, InternalError
from ...transfer import EmbeddingLayout, deepstack_layout
from .._media._limits import ResizeRule
from .._media._policy import item_label
from ._qwen_tower import QwenTower
from ._qwen_video import check_frame_sizes, fast_clip, paired_frames

if TYPE_CHECKING:
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

__all__ = ["QWEN3_VIDEO_MAX_PIXELS", "QWEN3_VIDEO_MIN_PIXELS", "Qwen3VisionModel"]

#: Qwen3VLVideoProcessor's ``size`` defaults: the pixels of the whole clip (frames x height x
#: width) after resizing lie between these (32 = patch 16 x merge 2).
QWEN3_VIDEO_MIN_PIXELS: Final = 128 * 32 * 32
QWEN3_VIDEO_MAX_PIXELS: Final = 768 * 32 * 32


@final
class Qwen3VisionModel(QwenTower):
    """A Qwen3-VL (dense or MoE) vision tower with its processor.

    Build one with :func:`~encdisagg.models.load_model`; the constructor takes the parts.
    ``preprocess`` is safe from several threads at once; ``forward`` one thread at a time.

    :param tower: a ``Qwen3VLVisionModel`` or ``Qwen3VLMoeVisionModel`` on its device and dtype.
    :param image_processor: the image processor whose settings fix the token counts.
    :param name: the built-in name or checkpoint folder.
    :param media: which media items are accepted and from where.
    :param video_min_pixels: fewest pixels of a whole video clip after resizing (default
        :data:`QWEN3_VIDEO_MIN_PIXELS`).
    :param video_max_pixels: most pixels of a whole video clip after resizing (default
        :data:`QWEN3_VIDEO_MAX_PIXELS`).
    :param limits: the default media budgets.
    :param preprocess: ``"fast"``, ``"device"`` (the fast path on the tower's device) or
        ``"reference"`` (the image processor itself).
    :raises BadRequestError: naming ``model`` for another tower or mismatched patch sizes,
        ``preprocess`` for another mode.
    """

    _SUPPORTED = ("qwen3_vl_vision", "qwen3_vl_moe_vision")
    _VIDEO_PROCESSOR = "Qwen3VLVideoProcessor"
    _VIDEO_PIXELS = (QWEN3_VIDEO_MIN_PIXELS, QWEN3_VIDEO_MAX_PIXELS)
    _SHOWN = (
        ("type", "_model_type"),
        ("hidden_size", "_hidden_size"),
        ("deepstack_layers", "deepstack_layers"),
    )

    def _configure(self, config: Any) -> None:
        self._token_width = int(config.out_hidden_size)
        self._layout = deepstack_layout(self._token_width, len(config.deepstack_visual_indexes))
        self._hidden_size = self._layout.width
        # The budget prices each frame before the clip's length is known; the frames of the
        # shortest clip (one temporal patch) share the clip's pixels, so no frame gets more.
        square = self._factor * self._factor
        self._video_rule = ResizeRule(
            self._factor, square, max(square, self._video_pixels[1] // self._temporal)
        )

    def _video_identity(self) -> str:
        return json.dumps(self._video_pixels)

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
            factor=self._factor,
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

    def _rows(self, output: Any) -> torch.Tensor:
        # The main embedding, then each deepstack map: :attr:`embedding_layout`.
        sections = [output.pooler_output, *(output.deepstack_features or ())]
        if len(sections) != len(self._layout.sections) or any(
            section.dim() != 2 or section.shape[1] != self._token_width for section in sections
        ):
            shapes = [list(section.shape) for section in sections]
            raise InternalError(
                f"Encoder produced sections of shapes {shapes}, expected "
                f"{len(self._layout.sections)} of width {self._token_width}"
            )
        return torch.cat(sections, dim=1)
