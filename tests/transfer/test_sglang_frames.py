"""The SGLang header frame: a pickle we write by hand, read back by an allow-listing
unpickler written here (stand-ins for SGLang's classes; sglang is not needed)."""

from __future__ import annotations

import pickle
import pickletools

import pytest

from encdisagg import BadRequestError, Modality
from encdisagg.transfer._sglang_frames import SglangPart, sglang_header

from ._sglang_unpickle import (
    StandInDtype,
    StandInModality,
    StandInTensor,
    read_header,
)


def _ok(**changes: object) -> SglangPart:
    values: dict[str, object] = {
        "req_id": "9f2c_local_part_1",
        "num_parts": 2,
        "part_idx": 1,
        "modality": Modality.IMAGE,
        "send_time": 1_700_000_000.25,
        "grid": ((1, 4, 6), (1, 8, 8)),
        "shape": (22, 64),
        "dtype": "bfloat16",
    }
    values.update(changes)
    return SglangPart(**values)  # type: ignore[arg-type]


def test_a_part_reads_back_with_every_field_sglang_sets() -> None:
    state = read_header(sglang_header(_ok()))
    assert state == {
        "req_id": "9f2c_local_part_1",
        "num_parts": 2,
        "part_idx": 1,
        "grid_dim": StandInTensor([[1, 4, 6], [1, 8, 8]]),
        "modality": StandInModality(1),
        "embedding": None,
        "send_time": 1_700_000_000.25,
        "dtype": StandInDtype("bfloat16"),
        "shape": [22, 64],
        "_mr_ptr": None,
        "error_msg": None,
        "error_code": None,
        "video_timestamps": None,
        "second_per_grid_ts": None,
    }


def test_an_error_part_has_no_layout_and_no_aux_fields() -> None:
    frame = sglang_header(
        SglangPart(
            req_id="r_local_part_0",
            num_parts=1,
            part_idx=0,
            modality=Modality.VIDEO,
            send_time=1.5,
            error_msg="mm_items[0]: cannot decode image",
            error_code=400,
        )
    )
    state = read_header(frame)
    assert state["error_msg"] == "mm_items[0]: cannot decode image"
    assert state["error_code"] == 400
    assert type(state["error_code"]) is int
    assert state["modality"] == StandInModality(2)
    assert state["grid_dim"] is None
    assert state["shape"] is None
    assert state["dtype"] is None
    assert "video_timestamps" not in state


@pytest.mark.parametrize(
    ("modality", "value"), [(Modality.IMAGE, 1), (Modality.VIDEO, 2), (Modality.AUDIO, 3)]
)
def test_modalities_are_sglang_enum_values(modality: Modality, value: int) -> None:
    assert read_header(sglang_header(_ok(modality=modality)))["modality"] == StandInModality(value)


def test_only_allow_listed_globals_and_protocol_2_opcodes() -> None:
    frame = sglang_header(_ok(req_id="ünïcode_local_part_0", num_parts=2**40))
    names = []
    for opcode, arg, _pos in pickletools.genops(frame):
        assert opcode.proto <= 2
        if opcode.name == "GLOBAL":
            names.append(arg)
    assert sorted(set(names)) == [
        "sglang.srt.disaggregation.encoder.receiver EmbeddingData",
        "sglang.srt.managers.schedule_batch Modality",
        "torch bfloat16",
        "torch tensor",
    ]
    state = read_header(frame)
    assert state["req_id"] == "ünïcode_local_part_0"
    assert state["num_parts"] == 2**40


def test_a_ragged_grid_stays_a_list() -> None:
    state = read_header(sglang_header(_ok(grid=((1, 4, 6), (7,)))))
    assert state["grid_dim"] == [[1, 4, 6], [7]]


def test_a_refusing_unpickler_refuses_it() -> None:
    class RefuseAll(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            raise pickle.UnpicklingError(f"{module}.{name}")

    import io

    with pytest.raises(pickle.UnpicklingError, match="EmbeddingData"):
        RefuseAll(io.BytesIO(sglang_header(_ok()))).load()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dtype": "int8"}, "dtype 'int8'"),
        ({"shape": None}, "shape, dtype and grid"),
        ({"error_msg": "x", "error_code": 999}, "error_code must be an HTTP status"),
        ({"error_msg": "x", "error_code": None}, "error_code"),
        ({"send_time": float("nan")}, "send_time"),
    ],
)
def test_invalid_parts_are_refused(changes: dict[str, object], match: str) -> None:
    with pytest.raises(BadRequestError, match=match):
        _ok(**changes)


def test_video_timing_rides_in_sglang_s_aux_fields() -> None:
    part = _ok(
        modality=Modality.VIDEO,
        grid=((2, 4, 4), (3, 4, 4)),
        video_timestamps=((0.25, 1.25), (0.5, 1.5, 2.5)),
        second_per_grid_ts=(1.0, 0.5),
    )
    state = read_header(sglang_header(part))
    assert state["modality"] == StandInModality(2)
    assert state["video_timestamps"] == [[0.25, 1.25], [0.5, 1.5, 2.5]]
    assert state["second_per_grid_ts"] == StandInTensor([1.0, 0.5])
    with pytest.raises(BadRequestError, match="finite"):
        _ok(second_per_grid_ts=(float("inf"),))
