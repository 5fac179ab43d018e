"""Embedding layouts and the header's optional ``layout`` key."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from encdisagg import BadRequestError
from encdisagg.transfer import (
    EmbeddingHeader,
    EmbeddingLayout,
    decode_header,
    deepstack_layout,
    encode_header,
)

LAYOUT = deepstack_layout(4, 2)


def header(**changes: Any) -> EmbeddingHeader:
    fields: dict[str, Any] = {
        "req_id": "r#0",
        "num_parts": 1,
        "part_idx": 0,
        "modality": "image",
        "shape": (3, 12),
        "dtype": "float32",
        "token_counts": (1, 2),
        "grid": ((1, 2, 2), (1, 2, 4)),
        "layout": LAYOUT,
    }
    fields.update(changes)
    return EmbeddingHeader(**fields)


def raw_fields(**changes: Any) -> dict[str, Any]:
    fields = msgpack.unpackb(encode_header(header()))
    fields.update(changes)
    return dict(fields)


def test_deepstack_layout_names_its_sections() -> None:
    assert LAYOUT.sections == (("embedding", 4), ("deepstack_0", 4), ("deepstack_1", 4))
    assert LAYOUT.width == 12
    assert LAYOUT.names == ("embedding", "deepstack_0", "deepstack_1")
    assert deepstack_layout(8, 0).sections == (("embedding", 8),)


def test_split_gives_views_of_each_section() -> None:
    joint = torch.arange(36, dtype=torch.float32).view(3, 12)
    views = LAYOUT.split(joint)
    assert list(views) == ["embedding", "deepstack_0", "deepstack_1"]
    for index, view in enumerate(views.values()):
        assert view.untyped_storage().data_ptr() == joint.untyped_storage().data_ptr()
        assert torch.equal(view, joint[:, 4 * index : 4 * index + 4])
    with pytest.raises(BadRequestError, match="does not fit layout"):
        LAYOUT.split(torch.zeros(3, 11))


@pytest.mark.parametrize(
    "sections",
    [
        (),
        (("deepstack_0", 4),),
        (("embedding", 4), ("embedding", 4)),
        (("embedding", 0),),
        (("embedding", True),),
        (("embedding", 4.0),),
        (("Embedding", 4),),
        (("embedding", 4, 1),),
        (("embedding", 1),) * 65,
    ],
)
def test_invalid_layouts_are_refused_naming_the_field(sections: Any) -> None:
    with pytest.raises(BadRequestError, match="'layout'"):
        EmbeddingLayout(sections)


def test_the_header_round_trips_its_layout_and_omits_an_absent_one() -> None:
    with_layout = header()
    assert decode_header(encode_header(with_layout)) == with_layout
    assert msgpack.unpackb(encode_header(with_layout))["layout"] == [
        ["embedding", 4],
        ["deepstack_0", 4],
        ["deepstack_1", 4],
    ]
    plain = header(layout=None, shape=(3, 4))
    assert "layout" not in msgpack.unpackb(encode_header(plain))
    assert decode_header(encode_header(plain)).layout is None


def test_a_nil_layout_reads_as_absent() -> None:
    fields = raw_fields(layout=None)
    assert decode_header(msgpack.packb(fields)).layout is None


def test_the_layout_must_cover_the_shape() -> None:
    with pytest.raises(BadRequestError, match="layout has 12 columns, but shape is 8 wide"):
        header(shape=(3, 8))
    with pytest.raises(BadRequestError, match="layout has 12 columns"):
        decode_header(msgpack.packb(raw_fields(shape=[3, 13])))


def test_an_error_part_carries_no_layout() -> None:
    with pytest.raises(BadRequestError, match="not allowed in an error part"):
        header(shape=(0, 0), token_counts=(), grid=(), error="boom", status=500)


@pytest.mark.parametrize(
    "value",
    ["embedding", [["embedding"]], [["embedding", "4"]], [[1, 4]], {"embedding": 4}, [[]]],
)
def test_malformed_wire_layouts_are_refused(value: object) -> None:
    with pytest.raises(BadRequestError, match="'layout'"):
        decode_header(msgpack.packb(raw_fields(layout=value)))
