"""Loading the audio encoders: built-in tiny models by name, or a local checkpoint folder.

A folder is recognised by the ``model_type`` of its ``config.json``:

- ``qwen2_audio``: a full Qwen2-Audio checkpoint (as published, or as
  :meth:`QwenAudioModel.save_pretrained` writes it); the ``audio_tower.*`` and
  ``multi_modal_projector.*`` weights are read (``model.``-prefixed too), the language
  model's are skipped.
- ``qwen2_5_omni`` / ``qwen2_5_omni_thinker``: a full Qwen2.5-Omni (or thinker) checkpoint;
  the ``thinker.audio_tower.*`` weights are read.
- ``qwen2_5_omni_audio_encoder``: the encoder alone.

Each needs ``preprocessor_config.json`` with the Whisper feature extractor's settings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoderConfig,
)
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder
from transformers.models.qwen2_audio.configuration_qwen2_audio import Qwen2AudioConfig
from transformers.models.qwen2_audio.modeling_qwen2_audio import (
    Qwen2AudioEncoder,
    Qwen2AudioMultiModalProjector,
)

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
from ._families._qwen_audio import QwenAudioModel
from ._media._policy import MediaPolicy
from ._tiny._audio import (
    build_tiny_qwen2_5_omni_thinker,
    build_tiny_qwen2_audio,
    tiny_audio_feature_extractor,
)

__all__ = ["AUDIO_BUILTIN_MODELS", "AUDIO_MODEL_TYPES", "is_audio_model", "load_audio_model"]

#: What a built-in builds: (encoder, projector or None, full config for save_pretrained).
_Parts = tuple[Any, torch.nn.Module | None, dict[str, Any]]


def _tiny_qwen2_audio() -> _Parts:
    full = build_tiny_qwen2_audio()
    return full.model.audio_tower, full.model.multi_modal_projector, full.config.to_dict()


def _tiny_qwen2_5_omni() -> _Parts:
    return build_tiny_qwen2_5_omni_thinker().model.audio_tower, None, {}


_BUILDERS: Final[dict[str, Callable[[], _Parts]]] = {
    "tiny-qwen2-audio": _tiny_qwen2_audio,
    "tiny-qwen2.5-omni-audio": _tiny_qwen2_5_omni,
}
AUDIO_BUILTIN_MODELS: Final = tuple(_BUILDERS)

_QWEN2_AUDIO_TYPES: Final = frozenset({"qwen2_audio"})
_OMNI_TYPES: Final = frozenset(
    {"qwen2_5_omni", "qwen2_5_omni_thinker", "qwen2_5_omni_audio_encoder"}
)
AUDIO_MODEL_TYPES: Final = _QWEN2_AUDIO_TYPES | _OMNI_TYPES

_QWEN2_AUDIO_KEYS: Final = {r"^model\.audio_tower\.": "", r"^audio_tower\.": ""}
_OMNI_KEYS: Final = {
    r"^thinker\.model\.audio_tower\.": "",
    r"^thinker\.audio_tower\.": "",
    r"^model\.audio_tower\.": "",
    r"^audio_tower\.": "",
}
_PROJECTOR_PREFIXES: Final = ("multi_modal_projector.", "model.multi_modal_projector.")


def is_audio_model(name: str) -> bool:
    """Whether ``name`` is a built-in audio model or a folder holding an audio checkpoint.
    Blocks on one small file read."""
    if name in _BUILDERS:
        return True
    config = Path(name).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False  # the vision loader reports the unreadable file
    return model_type in AUDIO_MODEL_TYPES


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text()).get("weight_map", {}).values()
        return [folder / shard for shard in sorted(set(shards))]
    return [folder / "model.safetensors"]


def _projector(
    folder: Path, name: str, config: Qwen2AudioConfig, dtype: torch.dtype
) -> torch.nn.Module:
    """Qwen2-Audio's projector, its weights read from the checkpoint's safetensors."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        if not path.is_file():
            raise BadRequestError(f"model: {name!r} lacks the weight file {path.name}")
        with safe_open(str(path), framework="pt") as shard:
            for key in shard.keys():  # noqa: SIM118  # a safetensors handle, not a dict
                for prefix in _PROJECTOR_PREFIXES:
                    if key.startswith(prefix):
                        weights[key.removeprefix(prefix)] = shard.get_tensor(key)
    projector = Qwen2AudioMultiModalProjector(config)
    missing = sorted(set(projector.state_dict()) - set(weights))
    if missing:
        raise BadRequestError(
            f"model: checkpoint {name!r} lacks multi_modal_projector weights ({', '.join(missing)})"
        )
    projector.load_state_dict(weights)
    projector.to(dtype)
    return projector


def _encoder_config(config: dict[str, Any], name: str) -> Qwen2_5OmniAudioEncoderConfig:
    model_type = config.get("model_type")
    if model_type == "qwen2_5_omni":
        config = config.get("thinker_config") or {}
    if model_type != "qwen2_5_omni_audio_encoder":
        config = config.get("audio_config") or {}
    if not isinstance(config, dict) or not config:
        raise BadRequestError(f"model: config.json of {name!r} has no audio_config")
    return Qwen2_5OmniAudioEncoderConfig.from_dict(config)


def _load_folder(folder: Path, name: str, dtype: torch.dtype | None) -> tuple[_Parts, Any]:
    config = read_json(folder / "config.json", name)
    model_type = config.get("model_type")
    require_preprocessor(folder, name)
    dtype = dtype or declared_dtype(config, "audio_config") or torch.float32
    projector: torch.nn.Module | None = None
    try:
        extractor = WhisperFeatureExtractor.from_pretrained(folder, local_files_only=True)
        if model_type in _QWEN2_AUDIO_TYPES:
            full = Qwen2AudioConfig.from_pretrained(folder, local_files_only=True)
            encoder_class: Any = Qwen2AudioEncoder
            encoder_config: Any = full.audio_config
            keys = _QWEN2_AUDIO_KEYS
            projector = _projector(folder, name, full, dtype)
            saved = full.to_dict()
        else:
            encoder_class, encoder_config = Qwen2_5OmniAudioEncoder, _encoder_config(config, name)
            keys, saved = _OMNI_KEYS, {}
        encoder, info = from_checkpoint(
            encoder_class, folder, config=encoder_config, dtype=dtype, key_mapping=keys
        )
    except BadRequestError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadRequestError(f"model: cannot load checkpoint {name!r}: {exc}") from exc
    refuse_missing(info, name, "audio encoder")
    return (encoder, projector, saved), extractor


def load_audio_model(
    name: str, *, media: MediaPolicy, dtype: torch.dtype | None, device: torch.device
) -> QwenAudioModel:
    """Load an audio model by built-in name or from a local folder (see the module's
    docstring). Blocks while it builds or reads the weights; never touches the network.

    :param dtype: the encoder's dtype; ``None``: the checkpoint's own (``float32`` for the
        built-in models).
    :raises BadRequestError: naming ``model`` for an unloadable checkpoint, ``device`` for a
        device it cannot use.
    """
    if name in _BUILDERS:
        parts = _BUILDERS[name]()
        extractor = tiny_audio_feature_extractor()
        if dtype is not None:
            for module in parts[:2]:
                if module is not None:
                    cast_weights(module, dtype)
    else:
        parts, extractor = _load_folder(Path(name).expanduser(), name, dtype)
    encoder, projector, saved = parts
    move_to([encoder, projector], device, str(device))
    return QwenAudioModel(
        encoder,
        extractor,
        projector=projector,
        checkpoint_config=saved,
        name=name,
        media=media,
    )
