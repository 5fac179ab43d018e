"""Patch grids and token counts: the arithmetic that ties a processor's output to LLM tokens.

Pure functions over integers. Each raises ``ValueError`` for a grid no processor could have
produced, so a caller inside ``preprocess`` turns it into a rejected request.

The rules follow the model families' processors:

- Qwen2-VL family (images and videos): a ``(t, h, w)`` grid of patches; ``t·h·w`` patches;
  the merger folds ``merge_size x merge_size`` neighbouring patches into one token, so
  ``t·h·w / merge_size²`` tokens.
- Kimi family: 2-D ``[h, w]`` grids (Kimi-VL ``image_grid_hws``) or ``[t, h, w]`` rows
  (Kimi-K2.5/K3 ``grid_thws``); ``h·w / (merge_h·merge_w)`` tokens per row from the vision
  config's ``merge_kernel_size``. The temporal axis is pooled, so it adds patches, not tokens.
- Qwen audio encoders: the output length follows from the feature length by the strided
  convolutions (and, for the Qwen3 audio tower, 100-frame chunks).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .._modality import Modality

__all__ = [
    "audio_output_length",
    "grid_patches",
    "grid_tokens",
    "kimi_grid_patches",
    "kimi_grid_tokens",
    "qwen2_audio_output_length",
    "qwen3_audio_output_length",
    "select_grid",
]

_log = logging.getLogger(__name__)

_V = TypeVar("_V")


def _checked_grid(grid: Sequence[int], sizes: tuple[int, ...]) -> tuple[int, ...]:
    values = tuple(grid)
    if len(values) not in sizes:
        wanted = " or ".join(str(size) for size in sizes)
        raise ValueError(f"a grid has {wanted} entries; got {list(values)}")
    for value in values:
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"grid entries must be positive integers; got {list(values)}")
    return tuple(int(value) for value in values)


def grid_patches(grid: Sequence[int]) -> int:
    """Patches (rows of ``pixel_values``) of a ``(t, h, w)`` grid: ``t·h·w``.

    :raises ValueError: if ``grid`` is not three positive integers.
    """
    return math.prod(_checked_grid(grid, (3,)))


def grid_tokens(grid: Sequence[int], merge_size: int) -> int:
    """LLM tokens of a ``(t, h, w)`` grid after a ``merge_size x merge_size`` merger.

    ``grid_tokens((1, 32, 32), 2) == 256``: a 448x448 image for Qwen2-VL.

    :raises ValueError: if ``grid`` is malformed or ``h``/``w`` are not multiples of
        ``merge_size`` (the merger could not fold such a grid).
    """
    t, h, w = _checked_grid(grid, (3,))
    if merge_size < 1:
        raise ValueError(f"merge_size must be positive; got {merge_size}")
    if h % merge_size or w % merge_size:
        raise ValueError(f"grid {[t, h, w]} is not divisible by merge_size {merge_size}")
    return t * h * w // (merge_size * merge_size)


def kimi_grid_patches(grid: Sequence[int]) -> int:
    """Patches of a Kimi grid row: ``h·w`` for ``[h, w]``, ``t·h·w`` for ``[t, h, w]``.

    :raises ValueError: if ``grid`` is not two or three positive integers.
    """
    return math.prod(_checked_grid(grid, (2, 3)))


def kimi_grid_tokens(grid: Sequence[int], merge_kernel_size: Sequence[int]) -> int:
    """Tokens of a Kimi grid row: ``h·w // (merge_h·merge_w)``, for ``[h, w]`` or ``[t, h, w]``.

    :raises ValueError: if ``grid`` or ``merge_kernel_size`` is malformed, or ``h``/``w`` are
        not multiples of the kernel.
    """
    *_, h, w = _checked_grid(grid, (2, 3))
    merge_h, merge_w = _checked_grid(merge_kernel_size, (2,))
    if h % merge_h or w % merge_w:
        raise ValueError(
            f"grid {list(grid)} is not divisible by merge_kernel_size {[merge_h, merge_w]}"
        )
    return (h * w) // (merge_h * merge_w)


# Which processor output holds the grid, per modality; the first one present wins.
_GRID_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "image": ("image_grid_thw", "image_grid_hws", "grid_thws"),
    "video": ("video_grid_thw",),
    "audio": ("audio_feature_lens_raw",),
}
# Kimi-VL's MoonViT reads 2-D grids, so its own ``image_grid_hws`` wins over a ``thw`` copy;
# Kimi-K2.5/K3 read ``grid_thws`` (which carry the temporal axis) over either.
_IMAGE_GRID_PREFERENCE: dict[str, tuple[str, ...]] = {
    "kimi_vl": ("image_grid_hws", "image_grid_thw", "grid_thws"),
    "kimi_k25": ("grid_thws", "image_grid_hws", "image_grid_thw"),
    "kimi_k3": ("grid_thws", "image_grid_hws", "image_grid_thw"),
}


def select_grid(
    outputs: Mapping[str, _V], modality: Modality, *, model_type: str | None = None
) -> tuple[str, _V]:
    """Pick the grid a processor output carries for ``modality``: ``(attribute, value)``.

    Images look at ``image_grid_thw``, ``image_grid_hws``, ``grid_thws`` in that order, except
    that Kimi-VL (``model_type="kimi_vl"``) prefers ``image_grid_hws`` and Kimi-K2.5/K3
    (``"kimi_k25"``, ``"kimi_k3"``) prefer ``grid_thws``. Videos use ``video_grid_thw``, audio
    ``audio_feature_lens_raw``.

    :raises ValueError: if ``outputs`` has none of the attributes for ``modality``.
    """
    if modality.value == "image" and model_type in _IMAGE_GRID_PREFERENCE:
        names = _IMAGE_GRID_PREFERENCE[model_type]
    else:
        names = _GRID_ATTRIBUTES[modality.value]
    for name in names:
        value = outputs.get(name)
        if value is not None:
            return name, value
    raise ValueError(
        f"processor output has no {modality.value} grid (looked for {', '.join(names)})"
    )


def _checked_length(length: int) -> int:
    if isinstance(length, bool) or int(length) != length or length < 1:
        raise ValueError(f"audio feature length must be a positive integer; got {length!r}")
    return int(length)


def qwen2_audio_output_length(length: int) -> int:
    """Audio tokens of Qwen2-Audio / Qwen2.5-Omni for ``length`` feature frames.

    A stride-2 convolution gives ``(L-1)//2 + 1`` frames, then a stride-2 pooling
    ``(L1-2)//2 + 1`` tokens: 3000 frames (30 s) → 750 tokens.

    :raises ValueError: if ``length`` is not a positive integer.
    """
    conv = (_checked_length(length) - 1) // 2 + 1
    return (conv - 2) // 2 + 1


_QWEN3_AUDIO_CHUNK = 100
_QWEN3_AUDIO_TOKENS_PER_CHUNK = 13


def qwen3_audio_output_length(length: int) -> int:
    """Audio tokens of Qwen3-ASR / Qwen3-Omni for ``length`` feature frames.

    The tower encodes 100-frame chunks, each through three stride-2 convolutions, so a full
    chunk gives 13 tokens and the remainder ``r`` gives ``ceil(ceil(ceil(r/2)/2)/2)``.

    :raises ValueError: if ``length`` is not a positive integer.
    """
    length = _checked_length(length)
    remainder = length % _QWEN3_AUDIO_CHUNK
    tail = remainder
    for _ in range(3):
        tail = (tail - 1) // 2 + 1
    return tail + (length // _QWEN3_AUDIO_CHUNK) * _QWEN3_AUDIO_TOKENS_PER_CHUNK


_QWEN2_AUDIO_MODELS = frozenset({"qwen2_audio", "qwen2_5_omni"})
_QWEN3_AUDIO_MODELS = frozenset({"qwen3_asr", "qwen3_omni_moe"})
_IDENTITY_AUDIO_MODELS = frozenset({"mimo_v2"})


def audio_output_length(length: int, model_type: str) -> int:
    """Audio tokens for ``length`` feature frames of a ``model_type`` audio encoder.

    Unknown model types use the Qwen2-Audio rule and log a warning, since a wrong count
    surfaces later as a token-count mismatch.

    :raises ValueError: if ``length`` is not a positive integer.
    """
    if model_type in _QWEN3_AUDIO_MODELS:
        return qwen3_audio_output_length(length)
    if model_type in _IDENTITY_AUDIO_MODELS:
        return _checked_length(length)
    if model_type not in _QWEN2_AUDIO_MODELS:
        _log.warning(
            "no audio token rule for model_type %r; using the Qwen2-Audio rule", model_type
        )
    return qwen2_audio_output_length(length)
