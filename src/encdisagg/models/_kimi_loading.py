"""Loading Kimi-K2.5 vision: the built-in ``"tiny-kimi-k25"`` or a ``kimi_k25`` checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import torch
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

from .._errors import BadRequestError
from ._checkpoint import (
    cast_weights,
    declared_dtype,
    from_checkpoint,
    move_to,
    read_json,
    refuse_missing,
    require_preprocessor,
)
from ._families._kimi import KimiK25VisionEncoder, KimiVisionModel
from ._families._kimi_processor import Kimi_K25ImageProcessorPil
from ._media._decode import MediaPolicy
from ._tiny._kimi import build_tiny_kimi_k25

__all__ = ["KIMI_BUILTIN_MODELS", "is_kimi_checkpoint", "load_kimi"]

KIMI_BUILTIN_MODELS: Final = ("tiny-kimi-k25",)
KIMI_MODEL_TYPE: Final = "kimi_k25"
# A full checkpoint written by transformers 5 keeps the vision half under ``model.``; the
# language model's weights are then unexpected and skipped.
_FULL_CHECKPOINT_KEYS: Final = {
    r"^model\.vision_tower\.": "vision_tower.",
    r"^model\.mm_projector\.": "mm_projector.",
}


def is_kimi_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a ``config.json`` of model type ``kimi_k25``. Blocks on a
    small read; an unreadable config is left for the caller to report."""
    path = folder / "config.json"
    if not path.is_file():
        return False
    try:
        return read_json(path, str(folder)).get("model_type") == KIMI_MODEL_TYPE
    except BadRequestError:
        return False


def _load_folder(
    folder: Path, name: str, dtype: torch.dtype | None
) -> tuple[KimiK25VisionEncoder, Kimi_K25ImageProcessorPil]:
    config = read_json(folder / "config.json", name)
    require_preprocessor(folder, name)
    dtype = dtype or declared_dtype(config, "vision_config") or torch.float32
    try:
        kimi_config = Kimi_K25Config.from_pretrained(folder, local_files_only=True)
        encoder, info = from_checkpoint(
            KimiK25VisionEncoder,
            folder,
            config=kimi_config,
            dtype=dtype,
            key_mapping=_FULL_CHECKPOINT_KEYS,
        )
        processor = Kimi_K25ImageProcessorPil.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadRequestError(f"model: cannot load checkpoint {name!r}: {exc}") from exc
    refuse_missing(info, name, "vision encoder")
    return encoder, processor


def load_kimi(
    name: str,
    *,
    dtype: torch.dtype | None,
    device: torch.device,
    media: MediaPolicy,
    preprocess: str = "fast",
) -> KimiVisionModel:
    """Build ``"tiny-kimi-k25"`` or load the ``kimi_k25`` checkpoint folder ``name``, on
    ``device`` in ``dtype`` (``None``: the checkpoint's own), preprocessing images the
    ``preprocess`` way (``"fast"`` or ``"reference"``). Blocks on the build or the
    reads; never touches the network.

    :raises BadRequestError: naming ``model`` for an unloadable checkpoint, ``device`` for
        one that cannot be used.
    """
    if name in KIMI_BUILTIN_MODELS:
        encoder = build_tiny_kimi_k25()
        processor = Kimi_K25ImageProcessorPil()
        if dtype is not None:
            cast_weights(encoder, dtype)
    else:
        encoder, processor = _load_folder(Path(name).expanduser(), name, dtype)
    move_to([encoder], device, str(device))
    return KimiVisionModel(encoder, processor, name=name, media=media, preprocess=preprocess)
