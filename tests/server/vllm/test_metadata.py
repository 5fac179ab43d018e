"""Which vLLM family a served model is, and the metadata keys each family's parser reads."""

from __future__ import annotations

import pytest

from encdisagg import BadRequestError, EncodeResult, Modality
from encdisagg._video_timing import video_timing
from encdisagg.server._vllm._metadata import check_family, family_of, item_metadata


@pytest.mark.parametrize(
    ("model", "model_type", "family"),
    [
        ("tiny", "qwen2_vl", "qwen2_vl"),
        ("ckpt", "qwen2_5_vl", "qwen2_vl"),
        ("ckpt", "qwen3_vl_moe", "qwen3_vl"),
        ("tiny-qwen2-audio", None, "qwen2_audio"),
        ("tiny-qwen2.5-omni-audio", None, "qwen2_5_omni"),
        ("ckpt", "qwen2_5_omni_thinker", "qwen2_5_omni"),
        ("tiny-kimi-k25", "kimi_k25", "kimi_k25"),
        ("ckpt", "llava", None),
        ("null", None, None),
    ],
)
def test_family_of(model: str, model_type: str | None, family: str | None) -> None:
    assert family_of(model, model_type) == family


def _video(**changes: object) -> EncodeResult:
    timing = video_timing(4, 2, fps=2.0)
    fields: dict[str, object] = {
        "req_id": "r",
        "num_tokens": 8,
        "hidden_size": 64,
        "dtype": "float32",
        "nbytes": 8 * 64 * 4,
        "token_counts": (8,),
        "grid": ((2, 4, 4),),
        "video_timing": (timing,),
    }
    fields.update(changes)
    return EncodeResult(**fields)  # type: ignore[arg-type]


def test_video_metadata_per_family() -> None:
    result = _video()
    timing = result.video_timing
    assert timing is not None
    assert item_metadata("qwen2_vl", Modality.VIDEO, result) == {"video_grid_thw": [2, 4, 4]}
    assert item_metadata("qwen3_vl", Modality.VIDEO, result) == {
        "video_grid_thw": [2, 4, 4],
        "timestamps": list(timing[0].timestamps),
    }
    assert item_metadata("qwen2_5_omni", Modality.VIDEO, result) == {
        "video_grid_thw": [2, 4, 4],
        "second_per_grid_ts": [1.0],  # temporal patch 2 at 2 fps
    }


def test_audio_metadata_per_family() -> None:
    result = _video(grid=((100,),), token_counts=(25,), num_tokens=25, video_timing=None)
    assert item_metadata("qwen2_audio", Modality.AUDIO, result) == {"audio_num_tokens": [25]}
    assert item_metadata("qwen2_5_omni", Modality.AUDIO, result) == {"audio_feature_lengths": [100]}


@pytest.mark.parametrize(
    ("family", "modality", "says"),
    [
        ("kimi_k25", Modality.IMAGE, "Kimi-K2.5"),
        (None, Modality.IMAGE, "not known"),
        ("qwen2_audio", Modality.IMAGE, "image items"),
        ("qwen2_vl", Modality.AUDIO, "audio items"),
    ],
)
def test_refused_with_a_400_naming_why(family: str | None, modality: Modality, says: str) -> None:
    with pytest.raises(BadRequestError, match=says) as caught:
        check_family(family, modality, "m")  # type: ignore[arg-type]
    assert caught.value.status == 400
