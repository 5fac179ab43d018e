"""What the Qwen2-VL family and Qwen3-VL adapters share: the parts and checks of their
constructors, the image and video preprocessing, the tower call and the checkpoint they write.

Both take images through ``Qwen2VLImageProcessorPil`` and build videos from it; they differ
in how a clip's frames are sized (:meth:`QwenTower._video_patches`), in their embedding
width and in what their towers return (:meth:`QwenTower._rows`), which each adapter supplies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import Qwen2VLImageProcessorPil

from ..._errors import BadRequestError
from ..._modality import Modality
from ..._video_timing import VideoTiming, video_timing
from .._grids import grid_tokens
from .._media._limits import MediaLimits, ResizeRule
from .._media._pixels import load_video
from .._media._policy import MediaPolicy, item_label
from .._media._video_items import video_source
from .._protocol import Preprocessed
from ._fast_pixels import fast_pixels
from ._qwen_video import GRID_THW, PIXEL_VALUES, VIDEO_CONFIG_NAME, check_shared_settings
from ._tower import (
    Patches,
    PerThread,
    TowerModel,
    architecture_json,
    checked_request,
    identity_digest,
    pixel_budget,
    settings_json,
    state_digest,
)

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedModel

    from ._fast_pixels import FastPixels

__all__ = ["QwenTower"]


class QwenTower(TowerModel):
    """A Qwen vision tower with its image processor. A subclass names the tower types it
    drives (``_SUPPORTED``), its video processor and that one's default pixel limits
    (``_VIDEO_PROCESSOR``, ``_VIDEO_PIXELS``), and defines ``_configure``,
    ``_video_patches`` and ``_rows``.

    :raises BadRequestError: naming ``model`` if ``tower`` is no supported vision tower or
        the processor's patch sizes do not match the tower's; ``preprocess`` for another mode.
    """

    #: The ``model_type`` of each vision tower the adapter drives.
    _SUPPORTED: ClassVar[tuple[str, ...]]
    #: The ``video_processor_type`` :meth:`save_pretrained` writes.
    _VIDEO_PROCESSOR: ClassVar[str]
    #: The video processor's default pixel limits.
    _VIDEO_PIXELS: ClassVar[tuple[int, int]]
    _feature_keys = (PIXEL_VALUES, GRID_THW)
    _MODALITIES = frozenset({Modality.IMAGE, Modality.VIDEO})
    _video_rule: ResizeRule

    def __init__(
        self,
        tower: PreTrainedModel,
        image_processor: Qwen2VLImageProcessorPil,
        *,
        name: str,
        media: MediaPolicy | None = None,
        video_min_pixels: int | None = None,
        video_max_pixels: int | None = None,
        limits: MediaLimits | None = None,
        preprocess: str = "fast",
    ) -> None:
        config: Any = tower.config
        model_type = getattr(config, "model_type", None)
        if model_type not in self._SUPPORTED:
            raise BadRequestError(
                f"model: {name!r} is a {model_type!r} model; supported vision towers are "
                f"{', '.join(self._SUPPORTED)}"
            )
        check_shared_settings(image_processor, config, name)
        module: torch.nn.Module = tower
        module.train(False)  # eval mode; via the base class, whose annotations mypy sees
        self._tower = self._weights = tower
        self._name = name
        self._model_type: str = model_type
        self._media = media or MediaPolicy()
        self._limits = limits or MediaLimits()
        self._processor_config: dict[str, Any] = image_processor.to_dict()
        self._merge_size = int(image_processor.merge_size)
        self._patch_size = int(image_processor.patch_size)
        self._temporal = int(image_processor.temporal_patch_size)
        self._factor = self._patch_size * self._merge_size
        low, high = self._VIDEO_PIXELS  # the defaults
        self._video_pixels = (
            low if video_min_pixels is None else video_min_pixels,
            high if video_max_pixels is None else video_max_pixels,
        )
        size = image_processor.size
        self._image_rule = ResizeRule(
            self._factor, int(size["shortest_edge"]), int(size["longest_edge"])
        )
        processor_config = dict(self._processor_config)
        self._processors = PerThread(
            image_processor, lambda: Qwen2VLImageProcessorPil.from_dict(dict(processor_config))
        )
        self._pixels = fast_pixels(image_processor, preprocess, self.device)
        self._identity = identity_digest(
            model_type,
            self._pixels_identity,
            architecture_json(config.to_dict()),
            settings_json(self._processor_config),
            self._video_identity(),
            state_digest(tower),
        )
        self._configure(config)

    def _configure(self, config: Any) -> None:
        """Set ``_hidden_size`` and ``_video_rule`` from the tower's ``config``."""
        raise NotImplementedError

    def _video_size(self) -> dict[str, int]:
        return {"shortest_edge": self._video_pixels[0], "longest_edge": self._video_pixels[1]}

    def _video_identity(self) -> str:
        """The video settings as the identity hashes them."""
        return json.dumps(self._video_size(), sort_keys=True)

    @property
    def merge_size(self) -> int:
        """Patches folded into one token along each spatial axis."""
        return self._merge_size

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
        patches: list[Patches] = []
        timings: list[VideoTiming] = []
        for index, item in enumerate(items):
            if modality is Modality.IMAGE:
                patches.append(self._image_item(processor, item, index, budget))
                continue
            source, fps = video_source(item, index)
            times: list[float] = []
            frames = load_video(source, index, self._media, budget=budget, frame_times=times)
            patches.append(self._video_patches(processor, frames, index))
            # The <t seconds> of each temporal patch, as the family's processor has them.
            timings.append(
                video_timing(len(frames), self._temporal, fps=fps, frame_times=times or None)
            )
        return self._result(
            patches,
            lambda row: grid_tokens(row, self._merge_size),
            tuple(timings) if modality is Modality.VIDEO else None,
        )

    def _fast_image(self, pixels: FastPixels, image: Image.Image, index: int) -> Patches:
        """:raises BadRequestError: naming ``mm_items[index]`` for an aspect ratio above 200."""
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
    ) -> Patches:
        """One video item's patches: each adapter sizes the frames."""
        raise NotImplementedError

    def _encode(self, firsts: list[torch.Tensor], seconds: list[torch.Tensor]) -> torch.Tensor:
        output = self._tower(
            torch.cat(firsts).to(self.device, self.dtype),
            grid_thw=torch.cat(seconds).to(self.device),
        )
        return self._rows(output)

    def _rows(self, output: Any) -> torch.Tensor:
        """The ``[tokens, hidden_size]`` rows of the tower's ``output``."""
        raise NotImplementedError

    def save_pretrained(self, folder: str | Path) -> None:
        """Write a checkpoint folder :func:`~encdisagg.models.load_model` loads back
        bit-identically: the tower's ``config.json`` and ``model.safetensors``, the image
        processor's ``preprocessor_config.json`` and ``video_preprocessor_config.json`` with
        the video pixel limits. Blocks on disk I/O.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tower.save_pretrained(folder)
        Qwen2VLImageProcessorPil.from_dict(dict(self._processor_config)).save_pretrained(folder)
        video = {
            "video_processor_type": self._VIDEO_PROCESSOR,
            "size": self._video_size(),
            "patch_size": self._patch_size,
            "temporal_patch_size": self._temporal,
            "merge_size": self._merge_size,
        }
        (folder / VIDEO_CONFIG_NAME).write_text(json.dumps(video, indent=2) + "\n")
