"""Loading Kimi-K2.5 vision: the built-in ``"tiny-kimi-k25"`` or a ``kimi_k25`` checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import torch
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

from .._errors import BadRequestError
from ._kimi import KimiK25VisionEncoder, KimiVisionModel
from ._kimi_processor import Kimi_K25ImageProcessorPil
from ._loading import _cast_weights, _declared_dtype, _move, _read_json
from ._media import MediaPolicy
from ._tiny_kimi import build_tiny_kimi_k25

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
        return _read_json(path, str(folder)).get("model_type") == KIMI_MODEL_TYPE
    except BadRequestError:
        return False


def _load_folder(
    folder: Path, name: str, dtype: torch.dtype | None
) -> tuple[KimiK25VisionEncoder, Kimi_K25ImageProcessorPil]:
    config = _read_json(folder / "config.json", name)
    if not (folder / "preprocessor_config.json").is_file():
        raise BadRequestError(f"model: {name!r} has no preprocessor_config.json")
    dtype = dtype or _declared_dtype(config) or torch.float32
    try:
        kimi_config = Kimi_K25Config.from_pretrained(folder, local_files_only=True)
        loader: Any = KimiK25VisionEncoder  # from_pretrained's annotations hide the pair
        encoder, info = loader.from_pretrained(
            folder,
            config=kimi_config,
            dtype=dtype,
            local_files_only=True,
            key_mapping=_FULL_CHECKPOINT_KEYS,
            use_safetensors=True,  # never unpickle weight files
            output_loading_info=True,
        )
        processor = Kimi_K25ImageProcessorPil.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadRequestError(f"model: cannot load checkpoint {name!r}: {exc}") from exc
    # As for the Qwen towers: random weights in place of missing ones would serve noise.
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:5])
        raise BadRequestError(
            f"model: checkpoint {name!r} lacks {len(missing)} vision encoder weights ({shown})"
        )
    return encoder, processor


def load_kimi(
    name: str,
    *,
    dtype: torch.dtype | None,
    device: torch.device,
    media: MediaPolicy,
) -> KimiVisionModel:
    """Build ``"tiny-kimi-k25"`` or load the ``kimi_k25`` checkpoint folder ``name``, on
    ``device`` in ``dtype`` (``None``: the checkpoint's own). Blocks on the build or the
    reads; never touches the network.

    :raises BadRequestError: naming ``model`` for an unloadable checkpoint, ``device`` for
        one that cannot be used.
    """
    if name in KIMI_BUILTIN_MODELS:
        encoder = build_tiny_kimi_k25()
        processor = Kimi_K25ImageProcessorPil()
        if dtype is not None:
            _cast_weights(encoder, dtype)
    else:
        encoder, processor = _load_folder(Path(name).expanduser(), name, dtype)
    try:
        _move(encoder, device)
    except (RuntimeError, AssertionError) as exc:
        raise BadRequestError(f"device: cannot use {str(device)!r}: {exc}") from exc
    return KimiVisionModel(encoder, processor, name=name, media=media)
