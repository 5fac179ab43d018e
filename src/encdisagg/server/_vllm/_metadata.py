"""The placeholder metadata vLLM's parser of each model family reads, from an encode result.

vLLM's PD takes an item's embedding in place of its media only with the values its
processor would have produced beside it: the keys the family's data parser declares as
``"metadata"`` among its ``embedding_fields``. Each value is what vLLM's producer reports,
``torch.atleast_1d(value).tolist()`` of the processor's per-item value:

- Qwen2-VL, Qwen2.5-VL: image ``image_grid_thw``; video ``video_grid_thw``.
- Qwen3-VL: image ``image_grid_thw``; video ``video_grid_thw`` and ``timestamps``.
- Qwen2-Audio: audio ``audio_num_tokens``.
- Qwen2.5-Omni thinker: image ``image_grid_thw``; video ``video_grid_thw`` and
  ``second_per_grid_ts``; audio ``audio_feature_lengths``.

Our Encoder computes the same values: an image or video item's grid row is ``(t, h, w)``,
an audio item's is ``(feature frames,)`` (``feature_attention_mask.sum(-1)``, what
``audio_feature_lengths`` holds) and its token count is ``audio_num_tokens``; a video item's
timing carries Qwen3-VL's ``timestamps`` and Qwen2.5's ``second_per_grid_ts``. Kimi-K2.5's
parser declares no metadata: vLLM's PD would encode such media itself, so it is refused.
Pure functions; the family is looked up once, when the wire opens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from ..._errors import BadRequestError, InternalError
from ..._modality import Modality
from ...encoder import EncodeResult

__all__ = ["Family", "check_family", "family_of", "item_metadata"]

Family = Literal["qwen2_vl", "qwen3_vl", "qwen2_audio", "qwen2_5_omni", "kimi_k25"]

#: ``model_type`` (of a checkpoint's or a built-in model's config) -> its vLLM family.
_FAMILIES: Final[Mapping[str, Family]] = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_vl_vision": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen2_5_vl_vision": "qwen2_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_vision": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_vl_moe_vision": "qwen3_vl",
    "qwen2_audio": "qwen2_audio",
    "qwen2_audio_encoder": "qwen2_audio",
    "qwen2_5_omni": "qwen2_5_omni",
    "qwen2_5_omni_thinker": "qwen2_5_omni",
    "qwen2_5_omni_audio_encoder": "qwen2_5_omni",
    "kimi_k25": "kimi_k25",
}
#: Built-in model names whose type ``models._checkpoint.model_type_of`` does not list.
_BUILTIN_TYPES: Final[Mapping[str, str]] = {
    "tiny-qwen2-audio": "qwen2_audio",
    "tiny-qwen2.5-omni-audio": "qwen2_5_omni",
}
#: What each family's parser reads, per modality (an absent modality: none declared).
_DECLARED: Final[Mapping[Family, Mapping[Modality, tuple[str, ...]]]] = {
    "qwen2_vl": {Modality.IMAGE: ("image_grid_thw",), Modality.VIDEO: ("video_grid_thw",)},
    "qwen3_vl": {
        Modality.IMAGE: ("image_grid_thw",),
        Modality.VIDEO: ("video_grid_thw", "timestamps"),
    },
    "qwen2_audio": {Modality.AUDIO: ("audio_num_tokens",)},
    "qwen2_5_omni": {
        Modality.IMAGE: ("image_grid_thw",),
        Modality.VIDEO: ("video_grid_thw", "second_per_grid_ts"),
        Modality.AUDIO: ("audio_feature_lengths",),
    },
    "kimi_k25": {},
}


def family_of(model: str, model_type: str | None) -> Family | None:
    """The vLLM family of the served model (its name and ``config.json`` type), or
    ``None`` when vLLM's parsers are not known to declare metadata for it. Not async."""
    kind = _BUILTIN_TYPES.get(model, model_type)
    return None if kind is None else _FAMILIES.get(kind)


def check_family(family: Family | None, modality: Modality, model: str) -> None:
    """Refuse an item whose metadata vLLM's parser does not declare. Not async.

    :raises BadRequestError: (400) naming the model and modality.
    """
    if family == "kimi_k25":
        raise BadRequestError(
            "Kimi-K2.5: vLLM's parser declares no placeholder metadata for it, so its PD "
            "would encode the media itself; use --wire encdisagg or sglang for this model"
        )
    if family is None:
        raise BadRequestError(
            f"model {model!r}: vLLM's placeholder metadata for this model family is not "
            "known to this encoder"
        )
    if modality not in _DECLARED[family]:
        raise BadRequestError(
            f"{modality.value} items: the served model ({family}) does not encode them for "
            "vLLM's PD"
        )


def item_metadata(family: Family, modality: Modality, result: EncodeResult) -> dict[str, Any]:
    """The metadata of the one item ``result`` holds, as vLLM's producer reports it; for a
    family and modality :func:`check_family` let through."""
    grid = list(result.grid[0])
    timing = result.video_timing[0] if result.video_timing else None
    out: dict[str, Any] = {}
    for key in _DECLARED[family][modality]:
        if key in ("image_grid_thw", "video_grid_thw"):
            out[key] = grid
        elif key == "audio_num_tokens":
            out[key] = [result.token_counts[0]]
        elif key == "audio_feature_lengths":
            out[key] = [grid[0]]
        elif timing is None:
            raise InternalError(f"req_id {result.req_id!r}: the video item has no timing")
        elif key == "timestamps":
            out[key] = list(timing.timestamps)
        else:  # second_per_grid_ts
            out[key] = [timing.second_per_grid_ts]
    return out
