"""The optional ``video_timing`` header field: carried exactly, checked against the grid, and
absent (the header unchanged) for every other part."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from encdisagg import BadRequestError
from encdisagg._video_timing import VideoTiming, video_timing
from encdisagg.transfer import EmbeddingHeader, decode_header, encode_header

TIMINGS = (video_timing(8, 2, fps=2.0), video_timing(5, 2, fps=4.0))
GRID = ((4, 4, 4), (3, 4, 4))


def _header(**changes: Any) -> EmbeddingHeader:
    fields: dict[str, Any] = {
        "req_id": "r_local_part_0",
        "num_parts": 1,
        "part_idx": 0,
        "modality": "video",
        "shape": (28, 64),
        "dtype": "float32",
        "token_counts": (16, 12),
        "grid": GRID,
        "video_timing": TIMINGS,
    }
    fields.update(changes)
    return EmbeddingHeader(**fields)


def _raw(header: EmbeddingHeader) -> dict[str, Any]:
    raw: dict[str, Any] = msgpack.unpackb(encode_header(header), raw=False)
    return raw


def test_round_trip_is_exact() -> None:
    header = _header()
    raw = _raw(header)
    assert raw["video_timing"] == [
        {"fps": 2.0, "second_per_grid_ts": 1.0, "timestamps": [0.25, 1.25, 2.25, 3.25]},
        {"fps": 4.0, "second_per_grid_ts": 0.5, "timestamps": [0.125, 0.625, 1.0]},
    ]
    assert decode_header(encode_header(header)) == header


def test_other_parts_carry_no_key() -> None:
    header = _header(modality="image", grid=((1, 8, 8), (1, 4, 12)), video_timing=None)
    assert "video_timing" not in _raw(header)
    # A video part of an encoder that predates the field still decodes.
    untimed = _header(video_timing=None)
    assert decode_header(encode_header(untimed)).video_timing is None
    # An explicit nil is tolerated like the error fields' nils.
    raw = _raw(untimed) | {"video_timing": None}
    assert decode_header(msgpack.packb(raw)).video_timing is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"modality": "image"}, "video_timing on a image part"),
        ({"video_timing": TIMINGS[:1]}, "1 entries for 2 items"),
        (
            {"grid": ((3, 4, 4), (3, 4, 4)), "token_counts": (12, 12), "shape": (24, 64)},
            r"4 timestamps, but the item's grid \[3, 4, 4\]",
        ),
        (
            {"video_timing": (TIMINGS[0], VideoTiming(3.0, 0.5, (0.0, 0.5, 1.0)))},
            "not a whole number of frames",
        ),
        ({"video_timing": [*TIMINGS]}, "a tuple of VideoTiming"),
    ],
)
def test_inconsistent_timing_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        _header(**changes)


def test_decoding_refuses_what_construction_refuses() -> None:
    raw = _raw(_header())
    raw["video_timing"][1]["timestamps"] = [0.0]
    with pytest.raises(BadRequestError, match="1 timestamps"):
        decode_header(msgpack.packb(raw))
    raw = _raw(_header())
    raw["video_timing"][0]["fps"] = "2"
    with pytest.raises(BadRequestError, match=r"video_timing'\[0\]\.fps must be a finite number"):
        decode_header(msgpack.packb(raw))
    raw = _raw(_header())
    raw["video_timing"] = {"fps": 2.0}
    with pytest.raises(BadRequestError, match="must be a list"):
        decode_header(msgpack.packb(raw))


def test_error_parts_carry_no_timing() -> None:
    with pytest.raises(BadRequestError, match="not allowed in an error part"):
        _header(
            shape=(0, 0),
            token_counts=(),
            grid=(),
            video_timing=(),
            error="boom",
            status=500,
        )
