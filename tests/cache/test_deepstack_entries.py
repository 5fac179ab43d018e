"""Qwen3-VL's joint embeddings (main + deepstack sections) through the global tier's entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from encdisagg.models import Qwen3VisionModel, load_model

from .fakes import round_trip_through_global_tier

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def qwen3() -> Qwen3VisionModel:
    model = load_model("tiny-qwen3-vl")
    assert isinstance(model, Qwen3VisionModel)
    return model


async def test_a_global_hit_returns_the_same_bytes_and_sections(
    qwen3: Qwen3VisionModel, listening: int
) -> None:
    pixels = np.random.default_rng(5).integers(0, 256, (70, 100, 3), dtype=np.uint8)
    pre = qwen3.preprocess([Image.fromarray(pixels, "RGB")], "image")
    (rows,) = qwen3.forward([pre])
    hit = await round_trip_through_global_tier(qwen3, pre, rows, listening)
    assert (hit.tokens, hit.grid) == (pre.num_tokens, pre.grid[0])
    assert hit.rows.numpy().tobytes() == rows.numpy().tobytes()
    layout = qwen3.embedding_layout
    for name, section in layout.split(hit.rows).items():
        assert torch.equal(section, layout.split(rows)[name])
