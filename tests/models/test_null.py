from __future__ import annotations

import pytest
import torch

from encdisagg._modality import Modality
from encdisagg.models import NullVisionModel, VisionModel, grid_tokens


def test_satisfies_the_protocol() -> None:
    model = NullVisionModel()
    assert isinstance(model, VisionModel)
    assert (model.hidden_size, model.tokens_per_item, model.dtype) == (64, 16, torch.float16)
    assert model.name == "null"


def test_counts_and_grids() -> None:
    model = NullVisionModel(hidden_size=8, tokens_per_item=5)
    pre = model.preprocess([b"a", "b", object()], Modality.VIDEO)
    assert pre.token_counts == (5, 5, 5)
    assert all(grid_tokens(row, 2) == 5 for row in pre.grid)
    assert pre.cache_key is None  # an arbitrary object cannot be hashed by content


def test_forward_shapes_and_values() -> None:
    model = NullVisionModel(hidden_size=8, tokens_per_item=3, dtype=torch.bfloat16)
    first = model.preprocess([b"x", b"y"], "image")
    second = model.preprocess([object()], "audio")
    outputs = model.forward([first, second])
    assert [out.shape for out in outputs] == [(6, 8), (3, 8)]
    assert all(out.dtype == torch.bfloat16 and out.is_contiguous() for out in outputs)
    # One value per item, the same on every row of that item.
    assert torch.equal(outputs[1], torch.ones(3, 8, dtype=torch.bfloat16))
    rows = outputs[0].float()
    assert torch.all(rows[:3] == rows[0, 0])
    assert torch.all(rows[3:] == rows[3, 0])
    assert rows[0, 0] != rows[3, 0]


def test_deterministic_whatever_the_batch() -> None:
    model = NullVisionModel()
    items = [b"frame", "data:image/png;base64,AAAA"]
    pre = model.preprocess(items, Modality.IMAGE)
    alone = model.forward([pre])[0]
    batched = model.forward([model.preprocess([b"other"], "image"), pre])[1]
    fresh = NullVisionModel()
    again = fresh.forward([fresh.preprocess(items, "image")])[0]
    assert torch.equal(alone, batched)
    assert torch.equal(alone, again)
    # Values stay exact in float16.
    assert torch.equal(alone.float(), alone.float().round())


def test_cache_keys_follow_content() -> None:
    model = NullVisionModel()
    one = model.preprocess([b"a", b"b"], "image").cache_key
    assert one is not None
    assert one == model.preprocess([b"a", "b"], "image").cache_key
    assert one != model.preprocess([b"ab"], "image").cache_key
    assert one != NullVisionModel(hidden_size=32).preprocess([b"a", b"b"], "image").cache_key


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="positive"):
        NullVisionModel(hidden_size=0)
    assert NullVisionModel().forward([]) == []
