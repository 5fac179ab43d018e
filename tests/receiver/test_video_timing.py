"""Video timing end to end: the encoder's /encode answer and ZMQ header carry each video's
fps, second_per_grid_ts and timestamps, the receiver checks them and hands them over; answers
and headers whose timing does not fit the request are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from encdisagg import BadRequestError, Modality
from encdisagg._video_timing import VideoTiming, timing_to_wire, video_timing
from encdisagg.models import QwenVisionModel, load_model
from encdisagg.receiver import EmbeddingReceiver, EncoderClient, fetch_embeddings
from encdisagg.receiver._encoder_wire import PartMetadata
from encdisagg.receiver._plan import PartPlan, RequestPlan
from encdisagg.receiver._validate import check_agreement, check_metadata_timing
from encdisagg.transfer import EmbeddingHeader, MooncakeEngine

from .conftest import data_url, encoder_server

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tiny25() -> QwenVisionModel:
    return load_model("tiny-qwen2.5-vl")


def videos() -> list[Any]:
    frames = [data_url(56, 56, seed) for seed in range(5)]
    # Over HTTP a list of frames travels wrapped (a bare list is no mm_items entry).
    return [{"frames": frames, "fps": 4}, {"frames": frames[:2]}]


async def test_zmq_and_mooncake_carry_the_timing(
    tiny25: QwenVisionModel, mooncake_engines: tuple[MooncakeEngine, MooncakeEngine]
) -> None:
    items = videos()
    expected = tiny25.preprocess(items, Modality.VIDEO)
    assert expected.video_timing == (video_timing(5, 2, fps=4), video_timing(2, 2))
    reference = torch.cat(tiny25.forward([expected]))
    encoder_engine, receiver_engine = mooncake_engines
    receivers = {
        "zmq": EmbeddingReceiver(
            transport="zmq", hidden_size=tiny25.hidden_size, dtype=tiny25.dtype
        ),
        "mooncake": EmbeddingReceiver(
            transport="mooncake",
            hidden_size=tiny25.hidden_size,
            dtype=tiny25.dtype,
            engine=receiver_engine,
            landing_pages=40,  # frames are resized to at least 128 tokens each
            page_bytes=4096,
        ),
    }
    for transfer, receiver in receivers.items():
        engine = encoder_engine if transfer == "mooncake" else None
        async with (
            encoder_server(tiny25, transfer=transfer, engine=engine) as (url, _, _),
            EncoderClient([url]) as client,
            receiver,
            fetch_embeddings(client, receiver, "r", {"video": items}) as embeddings,
        ):
            joined = embeddings.of("video")
            assert joined is not None
            assert joined.grid == expected.grid
            assert joined.video_timing == expected.video_timing
            (part,) = embeddings.parts
            assert part.video_timing == expected.video_timing
            assert joined.tensor.numpy().tobytes() == reference.numpy().tobytes()


def _plan(modality: Modality) -> RequestPlan:
    part = PartPlan(
        rid="r",
        part_idx=0,
        num_parts=1,
        modality=modality,
        url="http://encoder",
        items=(None, None),
        first_item=0,
    )
    return RequestPlan(rid="r", parts=(part,))


TIMINGS = (video_timing(5, 2, fps=4.0), video_timing(2, 2))
GRID = [[3, 4, 4], [1, 4, 4]]


def _answer(**changes: Any) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "req_id": "r#0",
        "part_idx": 0,
        "embedding_size": 16 * 64 * 4,
        "embedding_len": 16,
        "embedding_dim": 64,
        "token_counts": [12, 4],
        "grid": GRID,
        "video_timing": timing_to_wire(TIMINGS),
    }
    answer.update(changes)
    return answer


class TestChecks:
    def test_answer_with_and_without_timing(self) -> None:
        metadata = PartMetadata.from_json(_answer())
        assert metadata.video_timing == TIMINGS
        check_metadata_timing(_plan(Modality.VIDEO), metadata, "answer")
        untimed = _answer()
        del untimed["video_timing"]
        assert PartMetadata.from_json(untimed).video_timing is None

    @pytest.mark.parametrize(
        ("changes", "modality", "message"),
        [
            ({}, Modality.IMAGE, "video_timing on a image part"),
            ({"video_timing": timing_to_wire(TIMINGS[:1])}, Modality.VIDEO, "1 entries for 2"),
            (
                {
                    "grid": [[2, 4, 4], [1, 4, 4]],
                    "token_counts": [8, 4],
                    "embedding_len": 12,
                    "embedding_size": 12 * 64 * 4,
                },
                Modality.VIDEO,
                "3 timestamps, but the item's grid",
            ),
        ],
    )
    def test_inconsistent_answers_are_refused(
        self, changes: dict[str, Any], modality: Modality, message: str
    ) -> None:
        metadata = PartMetadata.from_json(_answer(**changes))
        with pytest.raises(BadRequestError, match=message):
            check_metadata_timing(_plan(modality), metadata, "answer")

    def test_malformed_timing_is_refused_by_the_parser(self) -> None:
        with pytest.raises(BadRequestError, match=r"/encode answer: video_timing\[0\]"):
            PartMetadata.from_json(_answer(video_timing=[{"fps": 2}]))

    def test_header_and_answer_must_agree(self) -> None:
        metadata = PartMetadata.from_json(_answer())
        fields: dict[str, Any] = {
            "req_id": "r#0",
            "num_parts": 1,
            "part_idx": 0,
            "modality": "video",
            "shape": (16, 64),
            "dtype": "float32",
            "token_counts": (12, 4),
            "grid": ((3, 4, 4), (1, 4, 4)),
        }
        check_agreement(EmbeddingHeader(**fields, video_timing=TIMINGS), metadata)
        check_agreement(EmbeddingHeader(**fields), metadata)  # a header without timing
        shifted = (
            VideoTiming(fps=4.0, second_per_grid_ts=0.5, timestamps=(0.5, 1.0, 1.5)),
            TIMINGS[1],
        )
        with pytest.raises(BadRequestError, match="video_timing disagrees"):
            check_agreement(EmbeddingHeader(**fields, video_timing=shifted), metadata)
