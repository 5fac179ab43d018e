"""Reading each family's checkpoint folder: which config, tower and processor classes it uses
and how its weights' keys are laid out. What every family does around that (the dtype, the
processor's presence, the error handling, the refusal of missing weights) is
:func:`~._loading.load_model`'s, once for all of them.

Each reader takes the folder, the model's name, its ``config.json``, the dtype and what the
family's table entry keeps for the folder's ``model_type``, and returns the :class:`Parts` it
read with transformers' loading info. It may raise the library's errors; the loader turns
them into :class:`~encdisagg.BadRequestError`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple

import torch
from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
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
from ._checkpoint import from_checkpoint, read_json
from ._families._kimi import KimiK25VisionEncoder
from ._families._kimi_processor import Kimi_K25ImageProcessorPil
from ._families._qwen import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS
from ._families._qwen_video import VIDEO_CONFIG_NAME

__all__ = ["Parts", "read_audio", "read_kimi", "read_qwen"]

#: What a reader gives back from a folder, and the return of ``info``.
_Read = tuple["Parts", Mapping[str, Any]]


class Parts(NamedTuple):
    """What a family's adapter is built from: a built-in's or a checkpoint's."""

    #: The modules whose weights are cast and placed (``None`` skipped); the first is the
    #: adapter's first argument.
    modules: tuple[torch.nn.Module | None, ...]
    #: The image processor or feature extractor, the adapter's second argument.
    processor: Any
    #: Further keywords of the adapter (video limits, a projector, a checkpoint's config).
    keywords: Mapping[str, Any] = {}


# --- the Qwen2-VL family and Qwen3-VL ------------------------------------------------------
#: Full checkpoints keep the tower under ``model.visual.*`` (``visual.*`` in checkpoints
#: written by transformers 4).
_QWEN_KEYS: Final = {r"^model\.visual\.": "", r"^visual\.": ""}
#: Keys of a full checkpoint's language model (transformers 4 and 5 layouts): never read
#: into the tower, and not reported as unexpected (they are expected to be there).
_LANGUAGE_KEYS: Final = (r"^lm_head\.", r"^model\.(language_model|layers|embed_tokens|norm)\.")


@functools.cache
def _vision_only(tower_class: Any) -> Any:
    """``tower_class``, ignoring a full checkpoint's language-model keys when it loads."""
    ignored = [*(tower_class._keys_to_ignore_on_load_unexpected or ()), *_LANGUAGE_KEYS]
    return type(
        tower_class.__name__,
        (tower_class,),
        {"_keys_to_ignore_on_load_unexpected": ignored, "__module__": tower_class.__module__},
    )


def _video_limits(folder: Path, name: str) -> dict[str, int]:
    """The adapter's video pixel limits from the folder's video processor settings; none
    (the adapter's defaults) without them."""
    path = folder / VIDEO_CONFIG_NAME
    if not path.is_file():
        return {}
    config = read_json(path, name)
    size = config.get("size") or {}
    low = size.get("shortest_edge", config.get("min_pixels", VIDEO_MIN_PIXELS))
    high = size.get("longest_edge", config.get("max_pixels", VIDEO_MAX_PIXELS))
    if not (isinstance(low, int) and isinstance(high, int) and 0 < low <= high):
        raise BadRequestError(f"model: {VIDEO_CONFIG_NAME} of {name!r} has an invalid size")
    return {"video_min_pixels": low, "video_max_pixels": high}


def read_qwen(
    folder: Path, name: str, config: Mapping[str, Any], dtype: torch.dtype, classes: Any
) -> _Read:
    """A Qwen vision tower (``classes``: its config and tower classes), alone or in a full
    checkpoint whose language model is skipped, with its image processor and video limits."""
    config_class, tower_class = classes
    vision_config = config_class.from_pretrained(folder, local_files_only=True)
    tower, info = from_checkpoint(
        _vision_only(tower_class), folder, config=vision_config, dtype=dtype, key_mapping=_QWEN_KEYS
    )
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)
    return Parts((tower,), processor, _video_limits(folder, name)), info


# --- Kimi-K2.5 -----------------------------------------------------------------------------
#: A full checkpoint written by transformers 5 keeps the vision half under ``model.``; the
#: language model's weights are then unexpected and skipped.
_KIMI_KEYS: Final = {
    r"^model\.vision_tower\.": "vision_tower.",
    r"^model\.mm_projector\.": "mm_projector.",
}


def read_kimi(
    folder: Path, name: str, config: Mapping[str, Any], dtype: torch.dtype, classes: Any
) -> _Read:
    """Kimi-K2.5's vision tower and projector, with its image processor."""
    kimi_config = Kimi_K25Config.from_pretrained(folder, local_files_only=True)
    encoder, info = from_checkpoint(
        KimiK25VisionEncoder, folder, config=kimi_config, dtype=dtype, key_mapping=_KIMI_KEYS
    )
    processor = Kimi_K25ImageProcessorPil.from_pretrained(folder, local_files_only=True)
    return Parts((encoder,), processor), info


# --- Qwen2-Audio and Qwen2.5-Omni -----------------------------------------------------------
# ``qwen2_audio``: the ``audio_tower.*`` and ``multi_modal_projector.*`` weights are read
# (``model.``-prefixed too). ``qwen2_5_omni`` / ``qwen2_5_omni_thinker``: the
# ``thinker.audio_tower.*`` weights. ``qwen2_5_omni_audio_encoder``: the encoder alone.
_QWEN2_AUDIO_KEYS: Final = {r"^model\.audio_tower\.": "", r"^audio_tower\.": ""}
_OMNI_KEYS: Final = {
    r"^thinker\.model\.audio_tower\.": "",
    r"^thinker\.audio_tower\.": "",
    **_QWEN2_AUDIO_KEYS,
}
_PROJECTOR_PREFIXES: Final = ("multi_modal_projector.", "model.multi_modal_projector.")


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


def _omni_config(config: Mapping[str, Any], name: str) -> Qwen2_5OmniAudioEncoderConfig:
    model_type = config.get("model_type")
    if model_type == "qwen2_5_omni":
        config = config.get("thinker_config") or {}
    if model_type != "qwen2_5_omni_audio_encoder":
        config = config.get("audio_config") or {}
    if not isinstance(config, dict) or not config:
        raise BadRequestError(f"model: config.json of {name!r} has no audio_config")
    return Qwen2_5OmniAudioEncoderConfig.from_dict(config)


def read_audio(
    folder: Path, name: str, config: Mapping[str, Any], dtype: torch.dtype, classes: Any
) -> _Read:
    """A Qwen2-Audio encoder and projector (with the full config, which the adapter writes
    back) or a Qwen2.5-Omni encoder, with the Whisper feature extractor."""
    extractor = WhisperFeatureExtractor.from_pretrained(folder, local_files_only=True)
    if config.get("model_type") == "qwen2_audio":
        full = Qwen2AudioConfig.from_pretrained(folder, local_files_only=True)
        projector = _projector(folder, name, full, dtype)
        encoder, info = from_checkpoint(
            Qwen2AudioEncoder,
            folder,
            config=full.audio_config,
            dtype=dtype,
            key_mapping=_QWEN2_AUDIO_KEYS,
        )
        keywords = {"projector": projector, "checkpoint_config": full.to_dict()}
        return Parts((encoder, projector), extractor, keywords), info
    encoder_config = _omni_config(config, name)
    encoder, info = from_checkpoint(
        Qwen2_5OmniAudioEncoder, folder, config=encoder_config, dtype=dtype, key_mapping=_OMNI_KEYS
    )
    return Parts((encoder,), extractor), info
