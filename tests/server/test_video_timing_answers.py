"""``/encode`` answers and data-parallel results carry a video's timing; others are unchanged."""

from __future__ import annotations

import pytest

from encdisagg import BadRequestError, EncodeResult
from encdisagg._video_timing import timing_to_wire, video_timing
from encdisagg.server._messages import result_from_wire, result_json, result_to_wire

TIMINGS = (video_timing(4, 2, fps=2.0), video_timing(3, 2, fps=1.0))


def _result(**changes: object) -> EncodeResult:
    fields: dict[str, object] = {
        "req_id": "r",
        "num_tokens": 12,
        "hidden_size": 64,
        "dtype": "float32",
        "nbytes": 12 * 64 * 4,
        "token_counts": (8, 4),
        "grid": ((2, 4, 4), (2, 2, 4)),
        "video_timing": TIMINGS,
    }
    fields.update(changes)
    return EncodeResult(**fields)  # type: ignore[arg-type]


def test_answer_carries_timing_only_for_videos() -> None:
    assert result_json(_result(), 0)["video_timing"] == timing_to_wire(TIMINGS)
    assert "video_timing" not in result_json(_result(video_timing=None), 0)


def test_worker_results_round_trip() -> None:
    for result in (_result(), _result(video_timing=None)):
        assert result_from_wire(result_to_wire(result)) == result
    wire = result_to_wire(_result())
    wire["video_timing"] = [{"fps": 2.0}]
    with pytest.raises(BadRequestError, match=r"video_timing\[0\]"):
        result_from_wire(wire)
