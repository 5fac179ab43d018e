"""``load_model``: built-in tiny models by name, anything else from a local checkpoint folder.

One table, :data:`_FAMILIES`, says for every family of models its adapter, its built-in
names, the ``model_type`` values of the checkpoints it reads and its reader
(:mod:`~._readers`); what loading does around a family's own classes is written once here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from transformers import Qwen2VLImageProcessorPil
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
from ._checkpoint import (
    cast_weights,
    declared_dtype,
    move_to,
    parse_dtype,
    read_json,
)
from ._families._fast_pixels import check_mode
from ._families._kimi import KimiVisionModel
from ._families._kimi_processor import Kimi_K25ImageProcessorPil
from ._families._qwen import QwenVisionModel
from ._families._qwen3_vl import Qwen3VisionModel
from ._families._qwen_audio import QwenAudioModel
from ._media._policy import DEFAULT_MAX_MEDIA_BYTES, DEFAULT_MAX_VIDEO_FRAMES, MediaPolicy
from ._readers import Parts, read_audio, read_kimi, read_qwen
from ._tiny._audio import (
    build_tiny_qwen2_5_omni_thinker,
    build_tiny_qwen2_audio,
    tiny_audio_feature_extractor,
)
from ._tiny._kimi import build_tiny_kimi_k25
from ._tiny._qwen3_vl import build_tiny_qwen3_vl, qwen3_vl_image_processor
from ._tiny._qwen_vl import build_tiny_qwen2_5_vl, build_tiny_qwen2_vl

__all__ = ["BUILTIN_MODELS", "is_audio_model", "load_model", "parse_dtype"]


@dataclass(frozen=True)
class _Family:
    """How one family of models is built, read and wrapped."""

    #: The adapter: called with the parts' first module and processor, ``name=``,
    #: ``media=``, the parts' keywords and (for image families) ``preprocess=``.
    adapter: Callable[..., Any]
    #: Built-in name -> its seeded parts (float32, CPU).
    builtins: Mapping[str, Callable[[], Parts]]
    #: A checkpoint's ``model_type`` -> what the reader needs for it.
    model_types: Mapping[str, Any]
    #: Reads a checkpoint folder's parts (see :mod:`~._readers`).
    reader: Callable[..., tuple[Parts, Mapping[str, Any]]]
    #: The ``config.json`` section whose declared dtype is the checkpoint's own.
    dtype_section: str = "vision_config"
    #: What missing weights are called in the refusal.
    weights: str = "vision tower"
    #: Whether the adapter takes ``preprocess=`` (the image families).
    preprocesses: bool = True


def _qwen2_audio() -> Parts:
    full = build_tiny_qwen2_audio()
    projector = full.model.multi_modal_projector
    keywords = {"projector": projector, "checkpoint_config": full.config.to_dict()}
    return Parts((full.model.audio_tower, projector), tiny_audio_feature_extractor(), keywords)


# Full checkpoints (``qwen2_vl``) keep the tower under ``vision_config``; a tower alone is a
# ``*_vision`` checkpoint. Qwen3-VL's dense and MoE checkpoints share the adapter.
_QWEN2_TOWERS: Final = (Qwen2VLVisionConfig, Qwen2VisionTransformerPretrainedModel)
_QWEN2_5_TOWERS: Final = (Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel)
_QWEN3_TOWERS: Final = (Qwen3VLVisionConfig, Qwen3VLVisionModel)
_QWEN3_MOE_TOWERS: Final = (Qwen3VLMoeVisionConfig, Qwen3VLMoeVisionModel)
_AUDIO: Final = _Family(
    adapter=QwenAudioModel,
    builtins={
        "tiny-qwen2-audio": _qwen2_audio,
        "tiny-qwen2.5-omni-audio": lambda: Parts(
            (build_tiny_qwen2_5_omni_thinker().model.audio_tower,), tiny_audio_feature_extractor()
        ),
    },
    model_types=dict.fromkeys(
        ("qwen2_audio", "qwen2_5_omni", "qwen2_5_omni_thinker", "qwen2_5_omni_audio_encoder")
    ),
    reader=read_audio,
    dtype_section="audio_config",
    weights="audio encoder",
    preprocesses=False,
)
_FAMILIES: Final = (
    _Family(
        adapter=QwenVisionModel,
        builtins={
            "tiny": lambda: Parts(
                (build_tiny_qwen2_vl().model.visual,), Qwen2VLImageProcessorPil()
            ),
            "tiny-qwen2.5-vl": lambda: Parts(
                (build_tiny_qwen2_5_vl().model.visual,), Qwen2VLImageProcessorPil()
            ),
        },
        model_types={
            "qwen2_vl": _QWEN2_TOWERS,
            "qwen2_vl_vision": _QWEN2_TOWERS,
            "qwen2_5_vl": _QWEN2_5_TOWERS,
            "qwen2_5_vl_vision": _QWEN2_5_TOWERS,
        },
        reader=read_qwen,
    ),
    _Family(
        adapter=Qwen3VisionModel,
        builtins={
            "tiny-qwen3-vl": lambda: Parts(
                (build_tiny_qwen3_vl().model.visual,), qwen3_vl_image_processor()
            ),
        },
        model_types={
            "qwen3_vl": _QWEN3_TOWERS,
            "qwen3_vl_vision": _QWEN3_TOWERS,
            "qwen3_vl_moe": _QWEN3_MOE_TOWERS,
            "qwen3_vl_moe_vision": _QWEN3_MOE_TOWERS,
        },
        reader=read_qwen,
    ),
    _Family(
        adapter=KimiVisionModel,
        builtins={
            "tiny-kimi-k25": lambda: Parts((build_tiny_kimi_k25(),), Kimi_K25ImageProcessorPil())
        },
        model_types={"kimi_k25": None},
        reader=read_kimi,
        weights="vision encoder",
    ),
    _AUDIO,
)

BUILTIN_MODELS: Final = tuple(name for family in _FAMILIES for name in family.builtins)


def _family_of(name: str) -> tuple[_Family, dict[str, Any] | None]:
    """The family of the built-in ``name`` (no config), else of the checkpoint folder
    ``name``, with its ``config.json``. Blocks on one small read.

    :raises BadRequestError: naming ``model`` for a name that is neither, an unreadable
        ``config.json`` or a ``model_type`` no family reads.
    """
    for family in _FAMILIES:
        if name in family.builtins:
            return family, None
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise BadRequestError(
            f"model: {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
            "nor a checkpoint folder"
        )
    config = read_json(folder / "config.json", name)
    model_type = config.get("model_type")
    for family in _FAMILIES:
        if isinstance(model_type, str) and model_type in family.model_types:
            return family, config
    supported = (model_type for family in _FAMILIES for model_type in family.model_types)
    raise BadRequestError(
        f"model: {name!r} is a {model_type!r} checkpoint; supported model types are "
        f"{', '.join(supported)}"
    )


def is_audio_model(name: str) -> bool:
    """Whether ``name`` is a built-in audio model or a folder holding an audio checkpoint.
    Blocks on one small file read; an unloadable name is no audio model."""
    try:
        return _family_of(name)[0] is _AUDIO
    except BadRequestError:
        return False


def _read_folder(
    family: _Family, name: str, config: dict[str, Any], dtype: torch.dtype | None
) -> Parts:
    """The parts in the checkpoint folder ``name``, in ``dtype`` (``None``: the dtype its
    config declares, else float32). Blocks on the reads.

    :raises BadRequestError: naming ``model`` for a folder without processor settings, one
        the library cannot load, or weights it lacks.
    """
    folder = Path(name).expanduser()
    if not (folder / "preprocessor_config.json").is_file():
        raise BadRequestError(f"model: {name!r} has no preprocessor_config.json")
    dtype = dtype or declared_dtype(config, family.dtype_section) or torch.float32
    try:
        parts, info = family.reader(
            folder, name, config, dtype, family.model_types[config["model_type"]]
        )
    except BadRequestError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadRequestError(f"model: cannot load checkpoint {name!r}: {exc}") from exc
    # transformers fills missing weights with random ones and only logs it; a tower with
    # random layers would serve noise.
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise BadRequestError(
            f"model: checkpoint {name!r} lacks {len(missing)} {family.weights} weights "
            f"({', '.join(missing[:5])})"
        )
    return parts


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
        processor's), ``"device"`` (the same kernels on ``device``, from one upload of the
        decoded ``uint8`` pixels) or ``"reference"`` (transformers' processor itself). Audio
        ignores it.
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
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BadRequestError(f"device: invalid device {device!r}: {exc}") from exc
    # A Hub id (ORG/NAME) loads from its snapshot folder in the local cache, offline.
    name = resolve_hub_model(str(name_or_path), BUILTIN_MODELS)
    family, config = _family_of(name)
    if config is None:
        parts = family.builtins[name]()
        if wanted_dtype is not None:
            for module in parts.modules:
                if module is not None:
                    cast_weights(module, wanted_dtype)
    else:
        parts = _read_folder(family, name, config, wanted_dtype)
    move_to(parts.modules, target, device)
    options = {"preprocess": preprocess} if family.preprocesses else {}
    model: QwenVisionModel | Qwen3VisionModel | KimiVisionModel | QwenAudioModel = family.adapter(
        parts.modules[0], parts.processor, name=name, media=media, **parts.keywords, **options
    )
    return model
