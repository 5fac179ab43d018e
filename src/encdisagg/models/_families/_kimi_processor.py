"""Kimi-K2.5's image processor on the PIL backend, and the resize arithmetic it shares.

transformers ships ``Kimi_K25ImageProcessor`` on its torchvision backend only, and torchvision
cannot be installed beside this project's CPU torch. :class:`Kimi_K25ImageProcessorPil` is
the same processor on transformers' ``PilBackend``: the same settings and defaults, the same
resize rule ("navit": shrink to fit a patch budget and a per-side cap, never upscale, then
pad the bottom and right edges with zeros to a multiple of ``patch_size x merge_size``), the
same order (resize, pad, rescale, normalise) and the same output layout, so its grids and
token counts are the torchvision processor's. Pixel values differ from it only by the two
backends' bicubic kernels. Its saved ``preprocessor_config.json`` names
``Kimi_K25ImageProcessor``, so a checkpoint folder stays loadable by transformers too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
from transformers import BatchFeature
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import PILImageResampling, SizeDict
from transformers.processing_utils import ImagesKwargs
from transformers.utils.constants import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD

from .._media._limits import ResizeRule

__all__ = ["KimiResizeRule", "Kimi_K25ImageProcessorPil", "navit_size"]

#: Defaults of ``Kimi_K25ImageProcessor`` (transformers 5.24).
KIMI_PATCH_SIZE: Final = 14
KIMI_MERGE_SIZE: Final = 2
KIMI_MAX_PATCHES: Final = 16384
KIMI_MAX_SIDE_PATCHES: Final = 512


def navit_size(
    height: int,
    width: int,
    *,
    patch_size: int,
    merge_size: int,
    max_patches: int,
    max_side_patches: int,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Kimi's resize rule: ``((resized_h, resized_w), (padded_h, padded_w))`` in pixels.

    The image shrinks (never grows) by one factor until it has at most ``max_patches``
    whole patches and neither side exceeds ``max_side_patches`` patches; the result is then
    padded up to multiples of ``patch_size * merge_size``. Pure arithmetic; does not block.
    """
    patches_h = max(1, height // patch_size)
    patches_w = max(1, width // patch_size)
    side_cap = max_side_patches * patch_size
    scale = min(
        1.0,
        math.sqrt(max_patches / (patches_h * patches_w)),
        side_cap / height,
        side_cap / width,
    )
    resized_h = min(max(1, int(height * scale)), side_cap)
    resized_w = min(max(1, int(width * scale)), side_cap)
    factor = patch_size * merge_size
    return (resized_h, resized_w), (
        -(-resized_h // factor) * factor,
        -(-resized_w // factor) * factor,
    )


class _KimiImagesKwargs(ImagesKwargs, total=False):
    max_patches: int
    patch_size: int
    merge_size: int


# The class name keeps transformers' spelling: PilBackend.to_dict drops the "Pil" suffix, so
# the saved config names the upstream class.
class Kimi_K25ImageProcessorPil(PilBackend):
    """``Kimi_K25ImageProcessor`` on the PIL backend; see the module docstring.

    Call it as ``processor(images=[...], return_tensors="pt")``: ``pixel_values`` is
    ``[patches, 3, patch_size, patch_size]`` (each image's patches row by row),
    ``image_grid_thw`` one ``[1, h, w]`` row (in patches) per image. Blocks on CPU work.
    """

    do_resize = True
    resample = PILImageResampling.BICUBIC
    size = {"max_height": KIMI_MAX_SIDE_PATCHES, "max_width": KIMI_MAX_SIDE_PATCHES}  # noqa: RUF012
    max_patches = KIMI_MAX_PATCHES
    do_rescale = True
    do_normalize = True
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    do_convert_rgb = True
    patch_size = KIMI_PATCH_SIZE
    merge_size = KIMI_MERGE_SIZE
    valid_kwargs = _KimiImagesKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]  # noqa: RUF012  # transformers' API

    def _validate_preprocess_kwargs(  # type: ignore[override]  # upstream's signature
        self, size: SizeDict | None = None, **kwargs: Any
    ) -> Any:
        # The same refusal as upstream: one per-side cap, given as two equal keys.
        if size is not None and (size.max_height is None or size.max_height != size.max_width):
            raise ValueError(f"size must have equal 'max_height' and 'max_width' keys; got {size}")
        return super()._validate_preprocess_kwargs(size=size, **kwargs)

    def _preprocess(  # type: ignore[override]  # upstream's signature
        self,
        images: list[np.ndarray],
        do_resize: bool,
        size: SizeDict,
        resample: PILImageResampling | None,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: Any,
        image_std: Any,
        patch_size: int,
        merge_size: int,
        max_patches: int,
        return_tensors: Any = None,
        **kwargs: Any,
    ) -> BatchFeature:
        patches: list[torch.Tensor] = []
        grids: list[list[int]] = []
        for image in images:  # channels first, uint8
            if do_resize:
                (resized_h, resized_w), (padded_h, padded_w) = navit_size(
                    int(image.shape[-2]),
                    int(image.shape[-1]),
                    patch_size=patch_size,
                    merge_size=merge_size,
                    max_patches=max_patches,
                    max_side_patches=int(size.max_height or KIMI_MAX_SIDE_PATCHES),
                )
                image = self.resize(
                    image, SizeDict(height=resized_h, width=resized_w), resample=resample
                )
                padded: Any = self.pad([image], pad_size=SizeDict(height=padded_h, width=padded_w))
                image = padded[0]
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            values = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32))
            channels, height, width = values.shape
            grid_h, grid_w = height // patch_size, width // patch_size
            # [C, gh, p, gw, p] -> [gh, gw, C, p, p]: the patches row by row, each a small image.
            shaped = values.reshape(channels, grid_h, patch_size, grid_w, patch_size)
            patches.append(
                shaped.permute(1, 3, 0, 2, 4).reshape(-1, channels, patch_size, patch_size)
            )
            grids.append([1, grid_h, grid_w])
        data = {
            "pixel_values": torch.cat(patches) if len(patches) > 1 else patches[0],
            "image_grid_thw": torch.tensor(grids, dtype=torch.long),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)

    def get_number_of_image_patches(
        self, height: int, width: int, images_kwargs: dict[str, Any] | None = None
    ) -> int:
        """Patches of a ``height`` x ``width`` image, as upstream computes them for vLLM."""
        overrides = images_kwargs or {}
        side = overrides["size"]["max_height"] if "size" in overrides else self.size["max_height"]
        patch_size = int(overrides.get("patch_size", self.patch_size))
        _, (padded_h, padded_w) = navit_size(
            height,
            width,
            patch_size=patch_size,
            merge_size=int(overrides.get("merge_size", self.merge_size)),
            max_patches=int(overrides.get("max_patches", self.max_patches)),
            max_side_patches=int(side),
        )
        return (padded_h // patch_size) * (padded_w // patch_size)


@dataclass(frozen=True, slots=True)
class KimiResizeRule(ResizeRule):
    """Kimi's resize rule for the media budgets: the pixels the tower sees (padding
    included) for a ``width`` x ``height`` source."""

    patch_size: int = KIMI_PATCH_SIZE
    merge_size: int = KIMI_MERGE_SIZE
    max_patches: int = KIMI_MAX_PATCHES
    max_side_patches: int = KIMI_MAX_SIDE_PATCHES

    def navit(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """:func:`navit_size` of a ``width`` x ``height`` source. Does not block."""
        return navit_size(
            height,
            width,
            patch_size=self.patch_size,
            merge_size=self.merge_size,
            max_patches=self.max_patches,
            max_side_patches=self.max_side_patches,
        )

    def model_pixels(self, width: int, height: int) -> int:
        """Pixels after resizing and padding. Does not block."""
        _, (padded_h, padded_w) = self.navit(width, height)
        return padded_h * padded_w
