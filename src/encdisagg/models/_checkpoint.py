"""What every loader shares: dtype parsing and weight casting, placing modules on a device,
and reading a checkpoint folder (its JSON files, its safetensors weights). The loaders keep
only which classes and key layouts their family uses."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import torch

from .._errors import BadRequestError

__all__ = [
    "cast_weights",
    "declared_dtype",
    "from_checkpoint",
    "model_type_of",
    "move_to",
    "parse_dtype",
    "read_json",
]

_DTYPE_ALIASES: Final = {
    "fp32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
}


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """``"bfloat16"``, ``"bf16"``, ``torch.float16``... → a floating torch dtype; ``None`` and
    ``"auto"`` → ``None`` (the checkpoint's own dtype). Does not block.

    :raises BadRequestError: naming ``dtype`` for anything else.
    """
    if value is None or value == "auto":
        return None
    dtype: object = value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        dtype = _DTYPE_ALIASES.get(name, getattr(torch, name, None))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise BadRequestError(f"dtype must be a floating-point torch dtype; got {value!r}")
    return dtype


def declared_dtype(config: Mapping[str, Any], sub_config: str) -> torch.dtype | None:
    """The dtype a checkpoint's ``config.json`` declares: its ``sub_config``'s (e.g.
    ``vision_config``), else its own; ``None`` if neither names a valid one."""
    for source in (config.get(sub_config) or {}, config):
        declared = source.get("dtype") or source.get("torch_dtype")
        if isinstance(declared, str):
            try:
                return parse_dtype(declared)
            except BadRequestError:
                return None
    return None


def cast_weights(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters and saved buffers, as loading a checkpoint in ``dtype`` would.

    ``module.to(dtype)`` would also cast the unsaved buffers (the rotary ``inv_freq``), which
    transformers computes and keeps in float32; a bfloat16 copy of them changes the output,
    so a saved and reloaded model would no longer match the one that wrote it.
    """
    saved = set(module.state_dict())
    for prefix, submodule in module.named_modules():
        for name, buffer in list(submodule.named_buffers(recurse=False)):
            if f"{prefix}.{name}".lstrip(".") in saved and buffer.is_floating_point():
                submodule.register_buffer(name, buffer.to(dtype))
    for parameter in module.parameters():
        parameter.data = parameter.data.to(dtype)


def move_to(modules: Iterable[torch.nn.Module | None], device: torch.device, shown: str) -> None:
    """Move each module (``None`` skipped) to ``device`` in place. Blocks on the copies.

    :raises BadRequestError: naming ``device`` (as ``shown``) if it cannot be used.
    """
    try:
        for module in modules:
            if module is not None:
                # Through the base class: transformers' wrapper of ``to`` hides its type.
                module.to(device)
    except (RuntimeError, AssertionError) as exc:  # e.g. no CUDA in this build or machine
        raise BadRequestError(f"device: cannot use {shown!r}: {exc}") from exc


def read_json(path: Path, name: str) -> dict[str, Any]:
    """The JSON object in ``path``, a file of the checkpoint ``name``. Blocks on the read.

    :raises BadRequestError: naming ``model`` if it cannot be read or is no JSON object.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadRequestError(f"model: cannot read {path.name} of {name!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequestError(f"model: {path.name} of {name!r} is not a JSON object")
    return data


#: The built-in models' types.
_BUILTIN_TYPES: Final[Mapping[str, str]] = {
    "tiny": "qwen2_vl",
    "tiny-qwen2.5-vl": "qwen2_5_vl",
    "tiny-qwen3-vl": "qwen3_vl",
    "tiny-kimi-k25": "kimi_k25",
}


def model_type_of(model: str) -> str | None:
    """The ``model_type`` of a built-in name or a checkpoint folder's ``config.json``
    (``None`` when unknown or unreadable). Blocks on one small read."""
    if model in _BUILTIN_TYPES:
        return _BUILTIN_TYPES[model]
    try:
        config = read_json(Path(model) / "config.json", model)
    except BadRequestError:
        return None
    kind = config.get("model_type")
    return kind if isinstance(kind, str) else None


def from_checkpoint(
    loader: Any,
    folder: Path,
    *,
    config: Any,
    dtype: torch.dtype,
    key_mapping: Mapping[str, str],
) -> tuple[Any, dict[str, Any]]:
    """``loader.from_pretrained`` over the local safetensors of ``folder`` (weight files are
    never unpickled): the model and its loading info. Blocks on the reads; lets the
    library's errors through."""
    model, info = loader.from_pretrained(
        folder,
        config=config,
        dtype=dtype,
        local_files_only=True,
        key_mapping=dict(key_mapping),
        use_safetensors=True,
        output_loading_info=True,
    )
    return model, info
