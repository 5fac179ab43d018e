"""How a request's items are split into parts across encoders."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from encdisagg import BadRequestError, Modality
from encdisagg.receiver import assign_parts, part_req_id

URLS = ("http://e0", "http://e1", "http://e2")


def test_items_are_split_in_runs_and_numbered_modality_outer() -> None:
    plan = assign_parts("r", {"video": ["v0"], "IMAGE": ["i0", "i1", "i2", "i3"]}, URLS, start=1)
    assert [(p.modality, p.url, p.items, p.first_item) for p in plan.parts] == [
        (Modality.IMAGE, "http://e1", ("i0", "i1"), 0),
        (Modality.IMAGE, "http://e2", ("i2",), 2),
        (Modality.IMAGE, "http://e0", ("i3",), 3),
        (Modality.VIDEO, "http://e1", ("v0",), 0),
    ]
    assert [p.part_idx for p in plan.parts] == [0, 1, 2, 3]
    assert {p.num_parts for p in plan.parts} == {4}
    assert [p.req_id for p in plan.parts] == ["r#0", "r#1", "r#2", "r#3"]
    assert plan.modalities() == (Modality.IMAGE, Modality.VIDEO)


def test_fewer_items_than_encoders_make_fewer_parts() -> None:
    plan = assign_parts("r", {"image": ["a"]}, URLS, start=2)
    assert [(p.url, p.items) for p in plan.parts] == [("http://e2", ("a",))]
    assert part_req_id("r", 0) == plan.parts[0].req_id


@pytest.mark.parametrize(
    ("rid", "items", "urls", "match"),
    [
        ("", {"image": ["a"]}, URLS, "rid"),
        ("a#b", {"image": ["a"]}, URLS, "rid"),
        ("r", {"image": []}, URLS, "no media items"),
        ("r", {"image": ["a"]}, (), "urls"),
        ("r", {"smell": ["a"]}, URLS, "items modality"),
        ("r", {"image": "a.png"}, URLS, "must be a list"),
        ("r", ["a.png"], URLS, "must map a modality"),
    ],
)
def test_invalid_requests_name_the_field(
    rid: str, items: object, urls: tuple[str, ...], match: str
) -> None:
    with pytest.raises(BadRequestError, match=match):
        assign_parts(rid, items, urls)  # type: ignore[arg-type]


@given(
    images=st.integers(0, 9),
    videos=st.integers(0, 9),
    n_urls=st.integers(1, 5),
    start=st.integers(0, 20),
)
def test_plans_are_balanced_and_keep_item_order(
    images: int, videos: int, n_urls: int, start: int
) -> None:
    if images + videos == 0:
        return
    urls = tuple(f"http://e{i}" for i in range(n_urls))
    items = {"image": [f"i{k}" for k in range(images)], "video": [f"v{k}" for k in range(videos)]}
    plan = assign_parts("r", items, urls, start=start)
    for modality, values in ((Modality.IMAGE, items["image"]), (Modality.VIDEO, items["video"])):
        parts = [p for p in plan.parts if p.modality is modality]
        assert [i for p in parts for i in p.items] == values
        assert len(parts) == min(n_urls, len(values))
        sizes = [len(p.items) for p in parts]
        if sizes:
            assert max(sizes) - min(sizes) <= 1
            assert min(sizes) >= 1
        # Different encoders within a modality.
        assert len({p.url for p in parts}) == len(parts)
    # Modality-outer numbering.
    kinds = [p.modality for p in plan.parts]
    assert kinds == sorted(kinds, key=list(Modality).index)
    # Encoders share the load over the whole request within one item.
    per_url = [sum(len(p.items) for p in plan.parts if p.url == u) for u in urls]
    assert max(per_url) - min(per_url) <= 2
