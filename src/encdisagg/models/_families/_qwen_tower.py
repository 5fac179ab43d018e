"""What the Qwen2-VL family and Qwen3-VL adapters share: the image and video preprocessing.

Both take images through ``Qwen2VLImageProcessorPil`` and build videos from it; they differ
only in how a clip's frames are sized (:meth:`QwenTower._video_patches`), which each
adapter supplies, and in their towers' outputs (each has its own ``forward``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..._errors import BadRequestError
from ..._modality import Modality
from ..._video_timing import VideoTiming, video_timing
from .._grids import grid_tokens
from .._media._decode import MediaPolicy, item_label, load_image, load_video
from .._media._limits import MediaLimits, ResizeRule
from .._protocol import Preprocessed
from ._qwen_video import GRID_THW, PIXEL_VALUES
from ._tower import (
    PerThread,
    TowerModel,
    checked_request,
    content_key,
    image_patches,
    pixel_budget,
    pixels_key,
)
from .._media._video_items import video_source

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedModel, Qwen2VLImageProcessorPil

    from ._fast_pixels import FastPixels

__all__ = ["QwenTower"]


class QwenTower(TowerModel):
    """A Qwen vision tower with its image processor; a subclass sets, besides
    :class:`TowerModel`'s, ``_tower``, ``_media``, ``_merge_size``, ``_temporal`` (the
    processor's ``temporal_patch_size``), ``_image_rule``, ``_video_rule`` and
    ``_processors``, and defines ``_video_patches``."""

    _tower: PreTrainedModel
    _media: MediaPolicy
    _merge_size: int
    _temporal: int
    _image_rule: ResizeRule
    _video_rule: ResizeRule
    _processors: PerThread[Any]

    @property
    def merge_size(self) -> int:
        """Patches folded into one token along each spatial axis."""
        return self._merge_size

    @property
    def modalities(self) -> frozenset[Modality]:
        """The modalities ``preprocess`` accepts."""
        return frozenset({Modality.IMAGE, Modality.VIDEO})

    @property
    def tower(self) -> PreTrainedModel:
        """The underlying transformers vision tower."""
        return self._tower

    def preprocess(
        self,
        items: Sequence[object],
        modality: Modality | str,
        *,
        limits: MediaLimits | None = None,
    ) -> Preprocessed:
        """Decode and preprocess one request's images or videos. Blocks on CPU work, file
        reads and (when enabled) media downloads.

        Each image item becomes one ``(1, h, w)`` grid row; each video item one
        ``(t, h, w)`` row. The result's ``cache_key`` hashes the pixel values, the grid and
        :attr:`identity`. The budgets (``limits``, else :attr:`media_limits`) are checked
        against each item's header before it is decoded.

        :raises BadRequestError: naming ``modality`` for one this model does not encode,
            ``mm_items`` if ``items`` is not a list or has more than ``max_items``, or
            ``mm_items[i]`` for an item that cannot be fetched, decoded or preprocessed,
            or that passes a budget.
        """
        modality = checked_request(items, modality, self.modalities, self._name)
        budget = pixel_budget(
            limits or self._limits, len(items), self._image_rule, self._video_rule
        )
        processor = self._processors.get()
        pixel_values: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        timings: list[VideoTiming] = []
        sources: list[torch.Tensor] = []  # the fast path's resized uint8 pixels, per item
        for index, item in enumerate(items):
            resized: torch.Tensor | None = None
            if modality is Modality.IMAGE:
                image = load_image(item, index, self._media, budget=budget)
                if self._pixels is None:
                    values, grid = image_patches(processor, image, index)
                else:
                    values, grid, resized = self._fast_image(self._pixels, image, index)
            else:
                source, fps = video_source(item, index)
                times: list[float] = []
                frames = load_video(source, index, self._media, budget=budget, frame_times=times)
                values, grid, resized = self._video_patches(processor, frames, index)
                # The <t seconds> of each temporal patch, as the family's processor has them.
                timings.append(
                    video_timing(len(frames), self._temporal, fps=fps, frame_times=times or None)
                )
            pixel_values.append(values)
            grids.append(grid)
            if resized is not None:
                sources.append(resized)
        if not grids:
            return Preprocessed(token_counts=(), grid=(), features={}, cache_key=None)
        grid_thw = torch.cat(grids)
        rows = tuple(tuple(int(size) for size in row) for row in grid_thw.tolist())
        token_counts = tuple(grid_tokens(row, self._merge_size) for row in rows)
        # One item's tensor as it is: a copy of it would cost as much as making it.
        values = pixel_values[0] if len(pixel_values) == 1 else torch.cat(pixel_values)
        features = {PIXEL_VALUES: values, GRID_THW: grid_thw}
        if self._pixels is None:
            cache_key = content_key(self._identity, features, rows)
        else:
            cache_key = pixels_key(self._identity, sources, rows)
        return Preprocessed(
            token_counts=token_counts,
            grid=rows,
            features=features,
            cache_key=cache_key,
            video_timing=tuple(timings) if modality is Modality.VIDEO else None,
        )

    def _fast_image(
        self, pixels: FastPixels, image: Image.Image, index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One image's ``(pixel_values, grid_thw, resized uint8 pixels)`` on the fast path,
        sized by the processor's own rule. Blocks on CPU work.

        :raises BadRequestError: naming ``mm_items[index]`` for an aspect ratio above 200.
        """
        try:
            height, width = self._image_rule.resized(image.width, image.height)
        except ValueError as exc:  # the processor's refusal, in its words
            raise BadRequestError(f"{item_label(index)}: cannot preprocess image: {exc}") from exc
        values, resized = pixels.qwen_image(image, height, width)
        patch = pixels.patch_size
        grid = torch.tensor([[1, height // patch, width // patch]], dtype=torch.int64)
        return values, grid, resized

    def _video_patches(
        self, processor: Qwen2VLImageProcessorPil, frames: list[Image.Image], index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One video item's ``(pixel_values, grid_thw, resized uint8 frames)``, the last
        ``None`` on the processor's path: each adapter sizes the frames."""
        raise NotImplementedError
