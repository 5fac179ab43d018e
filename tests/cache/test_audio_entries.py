"""Audio embeddings (one-element grid rows) through the global tier's entries."""

from __future__ import annotations

import pytest

from encdisagg.models import QwenAudioModel, load_model

from ..models._audio_samples import clip
from .fakes import round_trip_through_global_tier

pytest.importorskip("soundfile")
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def omni() -> QwenAudioModel:
    model = load_model("tiny-qwen2.5-omni-audio")
    assert isinstance(model, QwenAudioModel)
    return model


async def test_a_global_hit_returns_the_same_bytes_and_grid(
    omni: QwenAudioModel, listening: int
) -> None:
    pre = omni.preprocess([clip(2.7, codec="flac")], "audio")
    assert pre.grid == ((270,),)
    (rows,) = omni.forward([pre])
    hit = await round_trip_through_global_tier(omni, pre, rows, listening)
    assert (hit.tokens, hit.grid) == (67, (270,))
    assert hit.rows.numpy().tobytes() == rows.numpy().tobytes()
