"""The ``/encode`` answer is validated strictly, naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from encdisagg import BadRequestError
from encdisagg.receiver import PartMetadata


def answer(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "req_id": "r#0",
        "part_idx": 0,
        "embedding_size": 5 * 64 * 4,
        "embedding_len": 5,
        "embedding_dim": 64,
        "token_counts": [4, 1],
        "grid": [[1, 4, 4], [1, 2, 2]],
    }
    base.update(changes)
    return {key: value for key, value in base.items() if value is not ...}


def test_a_valid_answer() -> None:
    metadata = PartMetadata.from_json(answer())
    assert metadata.token_counts == (4, 1)
    assert metadata.grid == ((1, 4, 4), (1, 2, 2))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"extra": 1}, "unknown field.*extra"),
        ({"grid": ...}, "missing field.*grid"),
        ({"part_idx": True}, "'part_idx'"),
        ({"embedding_len": -1}, "'embedding_len'"),
        ({"embedding_dim": 0}, "'embedding_dim'"),
        ({"token_counts": [4, "1"]}, "'token_counts'"),
        ({"grid": [[1, 4, 4], "x"]}, "'grid'"),
        ({"grid": 3}, "'grid'"),
        ({"req_id": ""}, "'req_id'"),
        ({"token_counts": [4, 2]}, "token_counts sum to 6"),
        ({"grid": [[1, 4, 4]]}, "1 grids for 2 items"),
    ],
)
def test_invalid_answers_name_the_field(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(BadRequestError, match=match):
        PartMetadata.from_json(answer(**changes))


def test_not_an_object() -> None:
    with pytest.raises(BadRequestError, match="JSON object"):
        PartMetadata.from_json([1, 2])
