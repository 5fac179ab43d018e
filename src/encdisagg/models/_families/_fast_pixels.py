"""The fast image path: decoded pixels resized in ``uint8``, patchified and normalised in one
pass into the tensor the tower reads.

The processors on transformers' PIL backend resize through PIL, then rescale, normalise and
patchify float copies of the whole image in NumPy, holding the GIL for much of it. Here the
decoded image becomes one ``uint8`` tensor, torch's antialiased resampling (the separable
filters PIL uses, including its bicubic ``a = -0.5``) resizes it in ``uint8``, the patches are
gathered in ``uint8`` and a single multiply-add per element writes the normalised values into
the output: the only float tensor is the result. Every step is a torch kernel that releases
the GIL, so several preprocessing threads run in parallel.

Sizes come from the same rules as the processors' (``smart_resize``, Kimi's ``navit_size``),
so grids and token counts are theirs exactly; pixel values differ from theirs only by the
two implementations' rounding of the resampled ``uint8`` values (a level or two).

The ``"device"`` mode runs the same steps on the model's device: the decoded ``uint8`` frames
are uploaded once (from pinned memory, without waiting, on CUDA), and everything after runs
there, so the output is already where the tower reads it. With the CPU as the device it is the
``"fast"`` mode exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
from PIL import Image

from ..._config import PREPROCESS_MODES
from ..._errors import BadRequestError

__all__ = ["PREPROCESS_MODES", "FastPixels", "check_mode", "fast_pixels", "has_uint8_kernels"]

# PIL's resampling filters (PILImageResampling values) torch's antialiased kernels reproduce.
_MODES: Final = {2: "bilinear", 3: "bicubic"}
#: Frames converted and resized per step: bounds the ``uint8`` copies of a long video's
#: source frames held at once.
_FRAMES_PER_STEP: Final = 8


def has_uint8_kernels(device: torch.device) -> bool:
    """Whether torch's antialiased resampling takes ``uint8`` on ``device`` (the CPU only);
    elsewhere the same filters run on floats, within two levels of the ``uint8`` result."""
    return device.type == "cpu"


def _uint8_frames(frames: list[Image.Image], device: torch.device) -> torch.Tensor:
    """RGB frames of one size as a contiguous ``[F, 3, H, W]`` ``uint8`` tensor on
    ``device``. Blocks on the copies (an upload to CUDA is only queued)."""
    width, height = frames[0].size
    # Pinned for CUDA: the upload is then one DMA queued on the stream; the caching host
    # allocator keeps the buffer until the copy has run, however soon it is dropped here.
    pinned = device.type == "cuda"
    buffer = torch.empty((len(frames), height, width, 3), dtype=torch.uint8, pin_memory=pinned)
    array = buffer.numpy()  # a view: PIL's pixels are copied straight into the tensor
    for number, frame in enumerate(frames):
        array[number] = np.asarray(frame)
    # Planar: the resize runs faster on it, its output comes out planar too, and each patch
    # row is then a run of contiguous pixels to gather. (On the CPU ``to`` copies nothing.)
    return buffer.to(device, non_blocking=pinned).permute(0, 3, 1, 2).contiguous()


@dataclass(frozen=True, slots=True)
class FastPixels:
    """One processor's settings as the fast path applies them. Immutable, so one value
    serves every preprocessing thread.

    :param mode: torch's name of the processor's resampling filter.
    :param scale: per channel, what a ``uint8`` value is multiplied by (rescale / std).
    :param bias: per channel, what is then added (-mean / std).
    :param patch_size: pixels per patch side.
    :param merge_size: patches per merged token side (Qwen's patch order groups them).
    :param temporal: frames per temporal patch (1 where the model has none).
    :param preprocess: the setting that chose this path, ``"fast"`` or ``"device"``.
    :param device: where the kernels run and the outputs live (the CPU for ``"fast"``);
        ``scale`` and ``bias`` are there too.
    """

    mode: str
    scale: torch.Tensor
    bias: torch.Tensor
    patch_size: int
    merge_size: int
    temporal: int
    preprocess: str
    device: torch.device

    def resized(self, frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """``[F, C, H, W]`` ``uint8`` frames resized to ``height`` x ``width``, or the same
        tensor when it has that size already. Blocks on CPU work (the GIL released); on
        another device the kernels are only queued."""
        source_height, source_width = frames.shape[-2:]
        if (source_height, source_width) == (height, width):
            return frames
        both = height != source_height and width != source_width
        # Both kernels resample one axis, round to uint8, then the other; torch always starts
        # with the width, PIL with the height when the width grows and the height shrinks.
        # The order changes the rounded (and clipped) values by up to a tenth of the range
        # on noisy images, so PIL's order is kept; and where the float kernels stand in for
        # the uint8 ones, which would resample both axes at once, the passes are made apart.
        if both and width > source_width and height < source_height:
            frames = self._interpolated(frames, height, source_width)
        elif both and not has_uint8_kernels(frames.device):
            frames = self._interpolated(frames, source_height, width)
        return self._interpolated(frames, height, width)

    def _interpolated(self, frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
        exact = has_uint8_kernels(frames.device)
        resized = torch.nn.functional.interpolate(
            frames if exact else frames.float(),
            size=(height, width),
            mode=self.mode,
            antialias=True,
            align_corners=False,
        )
        if not exact:  # rounded and clipped as the uint8 kernels round and clip each pass
            resized = resized.round_().clamp_(0, 255).to(torch.uint8)
        return resized.contiguous()  # one canonical layout, whatever the kernel returned

    def _normalised(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """``out = gathered * scale + bias`` over ``[N, C, ...]`` (``gathered`` broadcast to
        ``out``'s shape), written in place."""
        shape = (1, -1) + (1,) * (out.dim() - 2)
        # Cast while copying, then a same-dtype multiply and add: torch's vectorised paths.
        # (One mixed-dtype multiply-add runs element by element, several times slower.)
        out.copy_(gathered.expand(out.shape))
        out.mul_(self.scale.view(shape)).add_(self.bias.view(shape))

    def qwen_image(
        self, image: Image.Image, height: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's ``pixel_values`` in Qwen2-VL's layout, resized to ``height`` x
        ``width``: ``[h*w patches, C * temporal * P * P]``, the image in every temporal slot;
        and the resized ``[1, C, h, w]`` ``uint8`` pixels they follow from, both on
        :attr:`device`. Blocks on CPU work."""
        resized = self.resized(_uint8_frames([image], self.device), height, width)
        return self._qwen_patches(resized), resized

    def qwen_video(
        self, frames: list[Image.Image], height: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A clip's ``pixel_values`` in the video processors' layout: every frame resized to
        ``height`` x ``width``, consecutive frames paired along time (the last repeated to
        fill the final temporal patch); and the clip's resized ``uint8`` frames, both on
        :attr:`device`. Blocks on CPU work."""
        count = len(frames)
        padded = -(-count // self.temporal) * self.temporal
        clip = torch.empty((padded, 3, height, width), dtype=torch.uint8, device=self.device)
        for start in range(0, count, _FRAMES_PER_STEP):
            chunk = _uint8_frames(frames[start : start + _FRAMES_PER_STEP], self.device)
            clip[start : start + chunk.shape[0]] = self.resized(chunk, height, width)
        if padded > count:
            clip[count:] = clip[count - 1 : count]
        return self._qwen_patches(clip), clip

    def _qwen_patches(self, frames: torch.Tensor) -> torch.Tensor:
        frame_count, channels, height, width = frames.shape
        patch, merge, temporal = self.patch_size, self.merge_size, self.temporal
        slots = 1 if frame_count == 1 else temporal  # an image fills every slot with itself
        grid_t, grid_h, grid_w = frame_count // slots, height // patch, width // patch
        # [t, slot, C, h/m, m, P, w/m, m, P] -> [t, h/m, w/m, m, m, C, slot, P, P]: the
        # processors' row order (merge groups together) and, per row, channel, time, pixel.
        shaped = frames.reshape(
            grid_t, slots, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
        ).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        rows = grid_t * grid_h * grid_w
        gathered = shaped.reshape(rows, channels, slots, patch * patch)  # uint8, one copy
        out = torch.empty(
            (rows, channels, temporal, patch * patch), dtype=torch.float32, device=self.device
        )
        self._normalised(gathered, out)  # an image's one slot fills all of them
        return out.view(rows, -1)

    def kimi_image(
        self, image: Image.Image, resized: tuple[int, int], padded: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's ``pixel_values`` in Kimi-K2.5's layout: resized to ``resized``
        (height, width), zero-padded at the bottom and right to ``padded``, then
        ``[patches, C, P, P]`` row by row; and the padded ``uint8`` pixels, both on
        :attr:`device`. Blocks on CPU work."""
        frame = self.resized(_uint8_frames([image], self.device), *resized)[0]
        channels = frame.shape[0]
        height, width = padded
        canvas = torch.zeros((channels, height, width), dtype=torch.uint8, device=self.device)
        canvas[:, : resized[0], : resized[1]] = frame
        patch = self.patch_size
        grid_h, grid_w = height // patch, width // patch
        # [C, h, P, w, P] -> [h, w, C, P, P]: the patches row by row, each a small image.
        gathered = (
            canvas.view(channels, grid_h, patch, grid_w, patch)
            .permute(1, 3, 0, 2, 4)
            .reshape(grid_h * grid_w, channels, patch, patch)
        )
        out = torch.empty(gathered.shape, dtype=torch.float32, device=self.device)
        self._normalised(gathered, out)
        return out, canvas


def _per_channel(value: Any, channels: int) -> list[float]:
    values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
    return values * channels if len(values) == 1 else values


def check_mode(mode: object) -> None:
    """:raises BadRequestError: naming ``preprocess``, for a mode not in
    :data:`PREPROCESS_MODES`."""
    if mode not in PREPROCESS_MODES:
        raise BadRequestError(
            f"preprocess must be one of {', '.join(PREPROCESS_MODES)}; got {mode!r}"
        )


def fast_pixels(processor: Any, mode: str, device: torch.device | None = None) -> FastPixels | None:
    """The fast path for ``processor``'s settings, or ``None`` where ``mode`` is
    ``"reference"`` or the processor asks for what the fast path does not do (no resize, or a
    filter other than bicubic or bilinear): such a model keeps the processor. It runs on the
    CPU for ``"fast"``, on ``device`` (the model's; the CPU if ``None``) for ``"device"``.
    Does not block.

    :raises BadRequestError: naming ``preprocess``, for a ``mode`` not in
        :data:`PREPROCESS_MODES`.
    """
    check_mode(mode)
    resample = getattr(processor, "resample", None)
    if mode == "reference" or not getattr(processor, "do_resize", False):
        return None
    torch_mode = _MODES.get(int(resample)) if resample is not None else None
    if torch_mode is None:
        return None
    channels = 3
    scale = np.full(channels, 1.0)
    bias = np.zeros(channels)
    if getattr(processor, "do_rescale", False):
        scale *= float(processor.rescale_factor)
    if getattr(processor, "do_normalize", False):
        mean = np.array(_per_channel(processor.image_mean, channels))
        std = np.array(_per_channel(processor.image_std, channels))
        # ((x * rescale) - mean) / std, folded into one multiply-add per element.
        scale, bias = scale / std, -mean / std
    where = torch.device("cpu") if mode == "fast" or device is None else torch.device(device)
    return FastPixels(
        mode=torch_mode,
        scale=torch.tensor(scale, dtype=torch.float32, device=where),
        bias=torch.tensor(bias, dtype=torch.float32, device=where),
        patch_size=int(processor.patch_size),
        merge_size=int(processor.merge_size),
        temporal=int(getattr(processor, "temporal_patch_size", 1) or 1),
        preprocess=mode,
        device=where,
    )
