from __future__ import annotations

import pytest
import torch

import encdisagg.models
from encdisagg import InternalError
from encdisagg.models import Preprocessed, split_embedding


class TestPreprocessed:
    def test_defaults(self) -> None:
        pre = Preprocessed(token_counts=(4,), grid=((1, 4, 4),))
        assert dict(pre.features) == {}
        assert pre.cache_key is None
        assert pre.num_tokens == 4

    def test_lists_become_tuples(self) -> None:
        pre = Preprocessed(token_counts=[4, 1], grid=[[1, 4, 4], [1, 2, 2]])  # type: ignore[arg-type]
        assert pre.token_counts == (4, 1)
        assert pre.grid == ((1, 4, 4), (1, 2, 2))

    def test_frozen(self) -> None:
        pre = Preprocessed(token_counts=(4,), grid=((1, 4, 4),))
        with pytest.raises(AttributeError):
            pre.cache_key = "x"  # type: ignore[misc]

    def test_counts_and_grid_must_agree(self) -> None:
        with pytest.raises(InternalError, match="2 token counts but 1 grid rows"):
            Preprocessed(token_counts=(4, 4), grid=((1, 4, 4),))
        with pytest.raises(InternalError, match="negative"):
            Preprocessed(token_counts=(-1,), grid=((1, 4, 4),))


class TestSplitEmbedding:
    def test_splits_into_views(self) -> None:
        rows = torch.arange(12.0).reshape(6, 2)
        first, second, third = split_embedding(rows, [1, 0, 5])
        assert first.tolist() == [[0.0, 1.0]]
        assert second.shape == (0, 2)
        assert third.shape == (5, 2)
        assert third.data_ptr() == rows[1].data_ptr()

    @pytest.mark.parametrize("counts", [[2, 3], [4, 3]])
    def test_exact_total(self, counts: list[int]) -> None:
        rows = torch.zeros(6, 2)
        expected = sum(counts)
        with pytest.raises(
            InternalError,
            match=f"Encoder produced 6 tokens, but preprocessor metadata expected {expected}",
        ):
            split_embedding(rows, counts)

    def test_rows_must_be_two_dimensional(self) -> None:
        with pytest.raises(InternalError, match="expected \\[tokens, hidden\\]"):
            split_embedding(torch.zeros(6), [6])


def test_public_names() -> None:
    for name in encdisagg.models.__all__:
        value = getattr(encdisagg.models, name)
        if isinstance(value, type) or callable(value):
            assert value.__module__ == "encdisagg.models", name
    assert {"Preprocessed", "VisionModel", "load_model", "NullVisionModel"} <= set(
        encdisagg.models.__all__
    )
