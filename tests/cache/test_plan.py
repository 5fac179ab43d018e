"""The per-item plan: hits fill items, only misses are preprocessed and forwarded, and the
result is assembled in item order."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from encdisagg import BadRequestError, InternalError
from encdisagg.cache import CachedItem, ItemPlan, KeySpace, ModalityKeys, Origin, relabel_items
from encdisagg.models import Preprocessed

HIDDEN = 4
LIMIT = 1 << 20


class Identified:
    identity = "plan-model"
    hidden_size = HIDDEN
    dtype = torch.float32


def key_builder() -> ModalityKeys:
    model: Any = Identified()
    return KeySpace.for_model(model).for_modality("image")


def rows(value: float, tokens: int) -> torch.Tensor:
    return torch.full((tokens, HIDDEN), value)


def cached(value: float, tokens: int) -> CachedItem:
    return CachedItem(rows=rows(value, tokens), tokens=tokens, grid=(1, 2, 2 * tokens))


def pre_of(counts: list[int], key: str | None = None) -> Preprocessed:
    return Preprocessed(
        token_counts=tuple(counts), grid=tuple((1, 2, 2 * n) for n in counts), cache_key=key
    )


def test_mixed_hits_and_misses_assemble_in_item_order() -> None:
    items: list[object] = [b"a", b"b", b"c", b"a"]
    plan = ItemPlan.build(items, None, key_builder(), max_media_bytes=LIMIT)
    assert plan.unkeyed() == []
    keys = plan.open_keys()
    assert len(keys) == 3  # b"a" twice: one key
    assert plan.fill(keys[1], cached(2.0, 3), Origin.GLOBAL) == 1
    # Misses: "a" (both places) and "c", preprocessed once each, together.
    assert plan.to_preprocess() == [0, 2]
    plan.set_preprocessed([0, 2], pre_of([1, 2]))
    batch = plan.forward_batch()
    assert len(batch) == 1
    plan.set_outputs([torch.cat([rows(1.0, 1), rows(3.0, 2)])])
    tensor, counts, grid = plan.assemble(torch.device("cpu"))
    assert counts == (1, 3, 2, 1)
    assert grid == ((1, 2, 2), (1, 2, 6), (1, 2, 4), (1, 2, 2))
    assert tensor[:, 0].tolist() == [1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 1.0]
    assert plan.origins() == [Origin.COMPUTED, Origin.GLOBAL, Origin.COMPUTED, Origin.COMPUTED]
    assert [key for key, _ in plan.computed()] == [keys[0], keys[2]]
    assert [key for key, _ in plan.fetched()] == [keys[1]]


def test_all_hits_need_no_forward_and_never_alias_the_cache() -> None:
    plan = ItemPlan.build([b"x"], None, key_builder(), max_media_bytes=LIMIT)
    entry = cached(5.0, 2)
    plan.fill(plan.open_keys()[0], entry, Origin.LOCAL)
    assert plan.to_preprocess() == []
    assert plan.forward_batch() == []
    tensor, _, _ = plan.assemble(torch.device("cpu"))
    assert torch.equal(tensor, entry.rows)
    assert tensor.data_ptr() != entry.rows.data_ptr()


def test_a_single_computed_item_is_staged_without_a_copy() -> None:
    plan = ItemPlan.build([b"x"], None, key_builder(), max_media_bytes=LIMIT)
    plan.set_preprocessed(plan.to_preprocess(), pre_of([2]))
    output = rows(1.0, 2)
    plan.forward_batch()
    plan.set_outputs([output])
    tensor, _, _ = plan.assemble(torch.device("cpu"))
    assert tensor.data_ptr() == output.data_ptr()


def test_items_keyed_by_preprocessing_forward_on_their_own() -> None:
    plan = ItemPlan.build(["/a.png", b"y", "/b.png"], None, key_builder(), max_media_bytes=LIMIT)
    assert plan.unkeyed() == [0, 2]
    plan.key_by_preprocessing(0, pre_of([2], key="model-key-a"))
    plan.key_by_preprocessing(2, pre_of([3], key=None))  # not cacheable
    assert len(plan.open_keys()) == 2
    assert plan.to_preprocess() == [1]
    plan.set_preprocessed([1], pre_of([1]))
    batch = plan.forward_batch()
    assert [pre.token_counts for pre in batch] == [(1,), (2,), (3,)]
    plan.set_outputs([rows(2.0, 1), rows(1.0, 2), rows(3.0, 3)])
    tensor, counts, _ = plan.assemble(torch.device("cpu"))
    assert counts == (2, 1, 3)
    assert tensor[:, 0].tolist() == [1.0, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert len(plan.computed()) == 2  # the uncacheable item is never inserted


def test_caller_hashes_key_the_items() -> None:
    builder = key_builder()
    plan = ItemPlan.build(["/a.png", 7], ["h1", "h2"], builder, max_media_bytes=LIMIT)
    assert plan.unkeyed() == []
    assert plan.open_keys() == [builder.for_hash("h1"), builder.for_hash("h2")]
    with pytest.raises(BadRequestError, match="hashes has 1 entries but items has 2"):
        ItemPlan.build([1, 2], ["h"], builder, max_media_bytes=LIMIT)


def test_contract_breaches_are_internal_errors() -> None:
    plan = ItemPlan.build([b"x", b"y"], None, key_builder(), max_media_bytes=LIMIT)
    with pytest.raises(InternalError, match="2 items gave 1"):
        plan.set_preprocessed([0, 1], pre_of([1]))
    with pytest.raises(InternalError, match="one item gave 2"):
        plan.key_by_preprocessing(0, pre_of([1, 1]))
    plan.set_preprocessed([0, 1], pre_of([1, 1]))
    plan.forward_batch()
    with pytest.raises(InternalError, match="expected 1 forward outputs"):
        plan.set_outputs([])
    with pytest.raises(InternalError, match="produced 3 tokens"):
        plan.set_outputs([rows(1.0, 3)])
    with pytest.raises(InternalError, match=r"mm_items\[0\] has no embedding"):
        plan.assemble(torch.device("cpu"))


def test_relabel_items() -> None:
    assert relabel_items("mm_items[0]: bad; mm_items[1]: worse", [3, 5]) == (
        "mm_items[3]: bad; mm_items[5]: worse"
    )
    assert relabel_items("mm_items[4]: unknown", [3]) == "mm_items[4]: unknown"
