"""The embedding push wire format (DESIGN §5.2): strict headers, exact payload framing."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from encdisagg import BadRequestError
from encdisagg.transfer import (
    MAX_HEADER_BYTES,
    EmbeddingHeader,
    decode_header,
    dtype_name,
    encode_header,
    payload_nbytes,
    payload_view,
    tensor_from_frame,
    torch_dtype,
)

DATA_KEYS = {
    "v",
    "req_id",
    "num_parts",
    "part_idx",
    "modality",
    "shape",
    "dtype",
    "token_counts",
    "grid",
}


def _fields(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "v": 1,
        "req_id": "req-1",
        "num_parts": 2,
        "part_idx": 1,
        "modality": "image",
        "shape": [320, 64],
        "dtype": "float16",
        "token_counts": [256, 64],
        "grid": [[1, 32, 32], [1, 16, 16]],
    }
    fields.update(changes)
    return {key: value for key, value in fields.items() if value is not _DROP}


_DROP = object()


def _packed(**changes: Any) -> bytes:
    data: bytes = msgpack.packb(_fields(**changes), use_bin_type=True)
    return data


def test_a_data_header_round_trips_with_exactly_the_contract_keys() -> None:
    header = decode_header(_packed())
    assert header == EmbeddingHeader(
        req_id="req-1",
        num_parts=2,
        part_idx=1,
        modality="image",
        shape=(320, 64),
        dtype="float16",
        token_counts=(256, 64),
        grid=((1, 32, 32), (1, 16, 16)),
    )
    assert not header.is_error
    raw = msgpack.unpackb(encode_header(header))
    assert set(raw) == DATA_KEYS
    assert raw == _fields()
    assert decode_header(encode_header(header)) == header
    assert payload_nbytes(header) == 320 * 64 * 2


def test_an_error_header_carries_error_and_status() -> None:
    header = EmbeddingHeader(
        req_id="req-2",
        num_parts=1,
        part_idx=0,
        modality="video",
        shape=(0, 0),
        dtype="float32",
        token_counts=(),
        grid=(),
        error="preprocessing failed: bad image",
        status=400,
    )
    raw = msgpack.unpackb(encode_header(header))
    assert set(raw) == DATA_KEYS | {"error", "status"}
    assert decode_header(encode_header(header)) == header
    assert header.is_error
    assert payload_nbytes(header) == 0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"v": 2}, "'v'"),
        ({"v": True}, "'v'"),
        ({"req_id": _DROP}, "missing field.*req_id"),
        ({"extra": 1}, "unknown field.*extra"),
        ({"req_id": ""}, "'req_id'"),
        ({"req_id": b"req-1"}, "'req_id'"),
        ({"num_parts": True}, "'num_parts'"),
        ({"num_parts": 0}, "'num_parts'"),
        ({"num_parts": 2.0}, "'num_parts'"),
        ({"part_idx": 2}, r"'part_idx' must be in \[0, num_parts=2\)"),
        ({"part_idx": -1}, "'part_idx'"),
        ({"modality": "IMAGE"}, "'modality'"),
        ({"modality": ["image"]}, "'modality'"),
        ({"shape": [-1, 64]}, "'shape'"),
        ({"shape": [320]}, "'shape'"),
        ({"shape": [320, 64, 1]}, "'shape'"),
        ({"shape": [320, False]}, "'shape'"),
        ({"shape": {"a": 1}}, "'shape'"),
        ({"dtype": "complex64"}, "'dtype'"),
        ({"dtype": "torch.float16"}, "'dtype'"),
        ({"dtype": ["float16"]}, "'dtype'"),
        ({"token_counts": [256.0, 64]}, "'token_counts'"),
        ({"token_counts": [256, 60]}, "token_counts sum to 316, but shape has 320 tokens"),
        ({"grid": [[1, -2]]}, "'grid'"),
        ({"grid": [1, 2]}, "'grid'"),
        ({"error": "boom"}, "'error' and 'status' must be given together"),
        ({"status": 500}, "'error' and 'status' must be given together"),
        ({"error": "boom", "status": 200}, "'status'"),
        ({"error": "", "status": 500}, "'error'"),
        ({"error": "boom", "status": True}, "'status'"),
    ],
)
def test_rejects_invalid_fields_naming_them(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequestError, match=message) as caught:
        decode_header(_packed(**changes))
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (_packed() + b"\x00", "not valid msgpack"),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "got a msgpack extension type"),
        (_packed(layout=msgpack.ExtType(5, b"x")), "not valid msgpack.*extension type 5"),
        (msgpack.packb([1, 2, 3]), "must be an object, got a list"),
        (msgpack.packb({b"v": 1}), "field name in embedding header must be a string, got bytes"),
        (msgpack.packb({1: 1}), "field name in embedding header must be a string"),
        (b"\x91" * 5000 + b"\x00", "must be an object, got a list"),
        # A field that takes any value (parsed by its own type) nested past any sane depth.
        (b"\x8a" + _packed()[1:] + msgpack.packb("layout") + b"\x91" * 5000, "not valid msgpack"),
        (b"\x00" * (MAX_HEADER_BYTES + 1), "limit"),
    ],
)
def test_rejects_undecodable_headers(data: bytes, message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        decode_header(data)


def test_explicit_nil_error_fields_mean_a_data_part() -> None:
    assert not decode_header(_packed(error=None, status=None)).is_error


def test_construction_validates_too() -> None:
    with pytest.raises(BadRequestError, match="'shape'"):
        EmbeddingHeader(
            req_id="r",
            num_parts=1,
            part_idx=0,
            modality="image",
            shape=[1, 2],  # type: ignore[arg-type]
            dtype="float16",
            token_counts=(1,),
            grid=((1,),),
        )


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_ever_raise_bad_request(data: bytes) -> None:
    with contextlib.suppress(BadRequestError):
        decode_header(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from([*sorted(DATA_KEYS), "error", "status", "junk"]),
        _msgpack_values,
        max_size=6,
    ),
    st.lists(st.sampled_from([*sorted(DATA_KEYS), "error", "status"]), max_size=3),
)
def test_random_maps_only_ever_raise_bad_request(
    replacements: dict[str, Any], dropped: list[str]
) -> None:
    fields = _fields(**replacements)
    for key in dropped:
        fields.pop(key, None)
    try:
        header = decode_header(msgpack.packb(fields, use_bin_type=True))
    except BadRequestError:
        return
    # Whatever got through is a valid header that survives another round trip.
    assert decode_header(encode_header(header)) == header


headers = st.builds(
    lambda req_id, num_parts, idx, modality, hidden, counts, dtype, grid_dims: EmbeddingHeader(
        req_id=req_id,
        num_parts=num_parts,
        part_idx=idx % num_parts,
        modality=modality,
        shape=(sum(counts), hidden),
        dtype=dtype,
        token_counts=tuple(counts),
        grid=tuple(tuple(g) for g in grid_dims),
    ),
    st.text(min_size=1, max_size=20),
    st.integers(1, 8),
    st.integers(0, 100),
    st.sampled_from(["image", "video", "audio"]),
    st.integers(0, 4096),
    st.lists(st.integers(0, 10_000), max_size=5),
    st.sampled_from(["float16", "bfloat16", "float32", "int64", "uint8"]),
    st.lists(st.lists(st.integers(0, 1000), max_size=3), max_size=5),
)


@settings(max_examples=200, deadline=None)
@given(headers)
def test_valid_headers_round_trip(header: EmbeddingHeader) -> None:
    assert decode_header(encode_header(header)) == header


def _header(shape: tuple[int, int], dtype: str) -> EmbeddingHeader:
    return EmbeddingHeader(
        req_id="r",
        num_parts=1,
        part_idx=0,
        modality="image",
        shape=shape,
        dtype=dtype,
        token_counts=(shape[0],),
        grid=((1, shape[0]),),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32])
def test_payload_round_trips_byte_exact(dtype: torch.dtype) -> None:
    tensor = (torch.randn(37, 24) * 100).to(dtype)
    header = _header((37, 24), dtype_name(dtype))
    view = payload_view(tensor)
    assert view.nbytes == payload_nbytes(header)
    received = tensor_from_frame(header, bytearray(view))
    assert received.dtype == dtype
    assert received.shape == (37, 24)
    assert torch.equal(received.view(torch.uint8), tensor.view(torch.uint8))


def test_tensor_from_frame_is_zero_copy_over_writable_memory() -> None:
    buffer = bytearray(8 * 4 * 2)
    tensor = tensor_from_frame(_header((8, 4), "float16"), buffer)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert tensor.data_ptr() == address
    # Read-only memory is copied once rather than shared.
    copied = tensor_from_frame(_header((8, 4), "float16"), bytes(64))
    assert copied.shape == (8, 4)
    empty = tensor_from_frame(_header((0, 4), "float16"), b"")
    assert empty.shape == (0, 4)


def test_tensor_from_frame_rejects_size_mismatch_and_error_parts() -> None:
    with pytest.raises(BadRequestError, match="is 63 bytes; shape \\[8, 4\\] of float16 needs 64"):
        tensor_from_frame(_header((8, 4), "float16"), bytearray(63))
    error = EmbeddingHeader(
        req_id="r",
        num_parts=1,
        part_idx=0,
        modality="image",
        shape=(0, 0),
        dtype="float16",
        token_counts=(),
        grid=(),
        error="boom",
        status=500,
    )
    with pytest.raises(BadRequestError, match="error part"):
        tensor_from_frame(error, b"")


def test_payload_view_needs_a_contiguous_tensor_of_a_wire_dtype() -> None:
    with pytest.raises(BadRequestError, match="C-contiguous"):
        payload_view(torch.zeros(4, 4).t())
    with pytest.raises(BadRequestError, match="complex64"):
        payload_view(torch.zeros(4, dtype=torch.complex64))


def test_dtype_names() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert torch_dtype("float16") is torch.float16
    with pytest.raises(BadRequestError, match="'dtype'"):
        torch_dtype("half")
