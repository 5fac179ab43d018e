"""``load_model``: built-in tiny models by name, anything else from a local checkpoint folder."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import torch
from transformers import PreTrainedModel, Qwen2VLImageProcessorPil
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from .._errors import BadRequestError
from .._hub import resolve_hub_model
from ._audio_loading import AUDIO_BUILTIN_MODELS, is_audio_model, load_audio_model
from ._checkpoint import (
    cast_weights,
    declared_dtype,
    from_checkpoint,
    move_to,
    parse_dtype,
    read_json,
    refuse_missing,
    require_preprocessor,
)
from ._families._fast_pixels import check_mode
from ._families._kimi import KimiVisionModel
from ._families._qwen import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, QwenVisionModel
from ._families._qwen3_vl import QWEN3_VIDEO_MAX_PIXELS, QWEN3_VIDEO_MIN_PIXELS, Qwen3VisionModel
from ._families._qwen_audio import QwenAudioModel
from ._families._qwen_video import VIDEO_CONFIG_NAME
from ._media._decode import DEFAULT_MAX_MEDIA_BYTES, DEFAULT_MAX_VIDEO_FRAMES, MediaPolicy
from ._tiny._qwen3_vl import build_tiny_qwen3_vl, qwen3_vl_image_processor
from ._tiny._qwen_vl import build_tiny_qwen2_5_vl, build_tiny_qwen2_vl

__all__ = ["BUILTIN_MODELS", "load_model", "parse_dtype"]

_BUILDERS: Final[dict[str, Callable[[], PreTrainedModel]]] = {
    "tiny": lambda: build_tiny_qwen2_vl().model.visual,
    "tiny-qwen2.5-vl": lambda: build_tiny_qwen2_5_vl().model.visual,
    "tiny-qwen3-vl": lambda: build_tiny_qwen3_vl().model.visual,
}
# --- Kimi-K2.5: its own adapter and loader (_kimi_loading, imported on use) ---------------
_KIMI_BUILTINS: Final = ("tiny-kimi-k25",)


def _kimi_loader(name: str) -> Callable[..., KimiVisionModel] | None:
    """``load_kimi`` when ``name`` is a Kimi-K2.5 built-in or checkpoint folder, else None."""
    from ._kimi_loading import is_kimi_checkpoint, load_kimi  # it reuses this module's helpers

    if name in _KIMI_BUILTINS or is_kimi_checkpoint(Path(name).expanduser()):
        return load_kimi
    return None


BUILTIN_MODELS: Final = (*_BUILDERS, *_KIMI_BUILTINS, *AUDIO_BUILTIN_MODELS)

# model_type of a checkpoint's config.json -> (vision config class, tower class). Full
# checkpoints (``qwen2_vl``) keep the tower under ``vision_config`` and ``model.visual.*``
# (``visual.*`` in checkpoints written by transformers 4).
_TOWERS: Final[dict[str, tuple[Any, Any]]] = {
    "qwen2_vl": (Qwen2VLVisionConfig, Qwen2VisionTransformerPretrainedModel),
    "qwen2_vl_vision": (Qwen2VLVisionConfig, Qwen2VisionTransformerPretrainedModel),
    "qwen2_5_vl": (Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel),
    "qwen2_5_vl_vision": (Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel),
}
_FULL_CHECKPOINT_KEYS: Final = {r"^model\.visual\.": "", r"^visual\.": ""}


def _parse_device(device: str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BadRequestError(f"device: invalid device {device!r}: {exc}") from exc


def _video_limits(folder: Path, name: str) -> tuple[int, int]:
    path = folder / VIDEO_CONFIG_NAME
    if not path.is_file():
        return VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS
    config = read_json(path, name)
    size = config.get("size") or {}
    low = size.get("shortest_edge", config.get("min_pixels", VIDEO_MIN_PIXELS))
    high = size.get("longest_edge", config.get("max_pixels", VIDEO_MAX_PIXELS))
    if not (isinstance(low, int) and isinstance(high, int) and 0 < low <= high):
        raise BadRequestError(f"model: {VIDEO_CONFIG_NAME} of {name!r} has an invalid size")
    return low, high


# --- full checkpoints: the language model's weights are skipped without a report ---------
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


def _load_folder(
    folder: Path,
    name: str,
    dtype: torch.dtype | None,
    towers: Mapping[str, tuple[Any, Any]],
    video_defaults: tuple[int, int],
) -> tuple[PreTrainedModel, Qwen2VLImageProcessorPil, tuple[int, int]]:
    """The tower ``towers`` names for the folder's model type, its image processor and its
    video pixel limits (``video_defaults`` without a video processor config)."""
    config = read_json(folder / "config.json", name)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in towers:
        raise BadRequestError(
            f"model: {name!r} is a {model_type!r} checkpoint; supported model types are "
            f"{', '.join(towers)}"
        )
    require_preprocessor(folder, name)
    config_class, tower_class = towers[model_type]
    dtype = dtype or declared_dtype(config, "vision_config") or torch.float32
    try:
        vision_config = config_class.from_pretrained(folder, local_files_only=True)
        tower, info = from_checkpoint(
            _vision_only(tower_class),
            folder,
            config=vision_config,
            dtype=dtype,
            key_mapping=_FULL_CHECKPOINT_KEYS,
        )
        processor = Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadRequestError(f"model: cannot load checkpoint {name!r}: {exc}") from exc
    refuse_missing(info, name, "vision tower")
    if not (folder / VIDEO_CONFIG_NAME).is_file():
        return tower, processor, video_defaults
    return tower, processor, _video_limits(folder, name)


def _tower_parts(
    name: str,
    dtype: torch.dtype | None,
    towers: Mapping[str, tuple[Any, Any]],
    video_defaults: tuple[int, int],
    builtin_processor: Callable[[], Qwen2VLImageProcessorPil],
) -> tuple[PreTrainedModel, Qwen2VLImageProcessorPil, tuple[int, int]]:
    """A Qwen vision tower, its image processor and video pixel limits: built when ``name``
    is a built-in (cast to ``dtype`` if given), else read from the folder ``name``."""
    if name in _BUILDERS:
        tower = _BUILDERS[name]()
        processor = builtin_processor()
        if dtype is not None:
            cast_weights(tower, dtype)
        return tower, processor, video_defaults
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise BadRequestError(
            f"model: {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
            "nor a checkpoint folder"
        )
    return _load_folder(folder, name, dtype, towers, video_defaults)


# --- Qwen3-VL: dense and MoE checkpoints share the tower; loaded by _load_qwen3_vl -------
_QWEN3_TOWERS: Final[dict[str, tuple[Any, Any]]] = {
    "qwen3_vl": (Qwen3VLVisionConfig, Qwen3VLVisionModel),
    "qwen3_vl_vision": (Qwen3VLVisionConfig, Qwen3VLVisionModel),
    "qwen3_vl_moe": (Qwen3VLMoeVisionConfig, Qwen3VLMoeVisionModel),
    "qwen3_vl_moe_vision": (Qwen3VLMoeVisionConfig, Qwen3VLMoeVisionModel),
}
_QWEN3_BUILTINS: Final = frozenset({"tiny-qwen3-vl"})


def _is_qwen3_vl(name: str) -> bool:
    if name in _QWEN3_BUILTINS:
        return True
    if name in _BUILDERS:
        return False
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        return False
    return read_json(path, name).get("model_type") in _QWEN3_TOWERS


def _load_qwen3_vl(
    name: str,
    dtype: torch.dtype | None,
    device: torch.device,
    media: MediaPolicy,
    preprocess: str,
) -> Qwen3VisionModel:
    tower, processor, video_limits = _tower_parts(
        name,
        dtype,
        _QWEN3_TOWERS,
        (QWEN3_VIDEO_MIN_PIXELS, QWEN3_VIDEO_MAX_PIXELS),
        qwen3_vl_image_processor,
    )
    move_to([tower], device, str(device))
    return Qwen3VisionModel(
        tower,
        processor,
        name=name,
        media=media,
        video_min_pixels=video_limits[0],
        video_max_pixels=video_limits[1],
        preprocess=preprocess,
    )


def load_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: str = "cpu",
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    remote_media_domains: Sequence[str] = (),
    remote_media_timeout_s: float = 10.0,
    allow_local_files: bool = True,
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
    preprocess: str = "fast",
) -> QwenVisionModel | Qwen3VisionModel | KimiVisionModel | QwenAudioModel:
    """Load a vision model by built-in name or from a local checkpoint folder. Blocks while it
    builds or reads the weights; never touches the network.

    Built-in names (they win over a folder of the same name): ``"tiny"``, a seeded random
    Qwen2-VL tower, and ``"tiny-qwen2.5-vl"``, its Qwen2.5-VL twin (see
    :func:`tiny_qwen2_vl_config`). Anything else is a folder in ``save_pretrained`` layout:
    ``config.json`` (a Qwen2-VL / Qwen2.5-VL vision tower, or a full Qwen2-VL / Qwen2.5-VL
    checkpoint, whose language model is skipped), safetensors weights and
    ``preprocessor_config.json``.

    Kimi-K2.5 (:class:`KimiVisionModel`): the built-in ``"tiny-kimi-k25"``, or a folder whose
    ``config.json`` is a ``kimi_k25`` checkpoint (transformers 5 layout) or its vision half.

    Audio (:class:`QwenAudioModel`): the built-ins ``"tiny-qwen2-audio"`` and
    ``"tiny-qwen2.5-omni-audio"``, or a folder whose ``config.json`` is a ``qwen2_audio``,
    ``qwen2_5_omni`` (or thinker) checkpoint or a ``qwen2_5_omni_audio_encoder``, with the
    Whisper feature extractor's ``preprocessor_config.json``.

    Qwen3-VL (:class:`Qwen3VisionModel`): the built-in ``"tiny-qwen3-vl"``, or a folder
    whose ``config.json`` is a ``qwen3_vl`` / ``qwen3_vl_moe`` checkpoint or its vision tower.

    :param dtype: the tower's dtype; ``None`` means the checkpoint's own (``float32`` for the
        built-in models).
    :param device: where the tower runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
    :param max_media_bytes: largest encoded media item accepted, in bytes.
    :param remote_media_domains: domains ``http(s)`` items may be fetched from; empty (the
        default) refuses every URL.
    :param remote_media_timeout_s: socket timeout of remote fetches.
    :param allow_local_files: whether items may name files on this machine.
    :param max_video_frames: most frames of one video item.
    :param preprocess: how images and video frames are preprocessed: ``"fast"`` (``uint8``
        resize with torch's antialiased kernels, one normalising pass; grids equal the
        processor's) or ``"reference"`` (transformers' processor itself). Audio ignores it.
    :raises BadRequestError: naming ``model`` for an unknown name, a missing folder or an
        unloadable checkpoint; ``dtype``, ``device``, ``preprocess`` or the media field for
        invalid values.
    """
    check_mode(preprocess)  # an unknown mode fails before anything is built
    media = MediaPolicy(
        max_media_bytes=max_media_bytes,
        remote_media_domains=tuple(remote_media_domains),
        remote_timeout_s=remote_media_timeout_s,
        allow_local_files=allow_local_files,
        max_video_frames=max_video_frames,
    )
    wanted_dtype = parse_dtype(dtype)
    target = _parse_device(device)
    name = str(name_or_path)
    # A Hub id (ORG/NAME) loads from its snapshot folder in the local cache, offline.
    name = resolve_hub_model(name, BUILTIN_MODELS)
    if kimi := _kimi_loader(name):
        return kimi(name, dtype=wanted_dtype, device=target, media=media, preprocess=preprocess)
    if _is_qwen3_vl(name):
        return _load_qwen3_vl(name, wanted_dtype, target, media, preprocess)
    if is_audio_model(name):
        return load_audio_model(name, media=media, dtype=wanted_dtype, device=target)
    tower, processor, video_limits = _tower_parts(
        name,
        wanted_dtype,
        _TOWERS,
        (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS),
        Qwen2VLImageProcessorPil,
    )
    move_to([tower], target, device)
    return QwenVisionModel(
        tower,
        processor,
        name=name,
        media=media,
        video_min_pixels=video_limits[0],
        video_max_pixels=video_limits[1],
        preprocess=preprocess,
    )
