"""The stored format: a header that says what the rows are, checked before anything is used."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings, strategies as st

from encdisagg.cache import InvalidEntryError, entry_header, read_entry
from encdisagg.cache._entry import ENTRY_MAGIC
from encdisagg.transfer import payload_view

HIDDEN = 8


def stored(
    rows: torch.Tensor, tokens: int | None = None, grid: tuple[int, ...] = (1, 2, 2)
) -> torch.Tensor:
    header = entry_header(rows.shape[0] if tokens is None else tokens, HIDDEN, rows.dtype, grid)
    value = header + bytes(payload_view(rows.contiguous()))
    return torch.frombuffer(bytearray(value), dtype=torch.uint8)


def with_header(fields: object, payload: bytes = b"") -> torch.Tensor:
    packed = msgpack.packb(fields)
    offset = -(-(8 + len(packed)) // 64) * 64
    value = struct.pack("<4sI", ENTRY_MAGIC, len(packed)) + packed
    value += bytes(offset - len(value)) + payload
    return torch.frombuffer(bytearray(value), dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_views_the_rows_in_place(dtype: torch.dtype) -> None:
    rows = torch.arange(5 * HIDDEN, dtype=torch.float32).reshape(5, HIDDEN).to(dtype)
    raw = stored(rows, grid=(1, 4, 5))
    entry = read_entry(raw, hidden=HIDDEN, dtype=dtype)
    assert (entry.tokens, entry.grid) == (5, (1, 4, 5))
    assert torch.equal(entry.rows, rows)
    assert entry.rows.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    assert len(entry_header(5, HIDDEN, dtype, (1, 4, 5))) % 64 == 0


def test_an_empty_entry_is_valid() -> None:
    entry = read_entry(stored(torch.zeros(0, HIDDEN)), hidden=HIDDEN, dtype=torch.float32)
    assert entry.rows.shape == (0, HIDDEN)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (stored(torch.zeros(3, HIDDEN), tokens=4), "needs"),
        (stored(torch.zeros(5, HIDDEN), tokens=4), "needs"),
        (torch.zeros(4, dtype=torch.uint8), "shorter"),
        (torch.zeros(200, dtype=torch.uint8), "magic"),
        (with_header([1, 2]), "entry header must be an object"),
        (with_header({"tokens": 1, "hidden": HIDDEN, "dtype": "float32"}), "missing field 'grid'"),
        (
            with_header({"tokens": 1, "hidden": HIDDEN, "dtype": "float32", "grid": [1], "x": 1}),
            "unknown field 'x'",
        ),
        (
            with_header({"tokens": True, "hidden": HIDDEN, "dtype": "float32", "grid": [1]}),
            "tokens must be an integer, got a boolean",
        ),
        (
            with_header({"tokens": -1, "hidden": HIDDEN, "dtype": "float32", "grid": [1]}),
            "tokens must be an integer >= 0",
        ),
        (with_header({"tokens": 0, "hidden": HIDDEN, "dtype": "float32", "grid": []}), "grid"),
        (with_header({"tokens": 0, "hidden": HIDDEN, "dtype": "float32", "grid": "ab"}), "grid"),
        (with_header({"tokens": 0, "hidden": 4, "dtype": "float32", "grid": [1]}), "4-wide"),
        (with_header({"tokens": 0, "hidden": HIDDEN, "dtype": "float16", "grid": [1]}), "float16"),
        (with_header({"tokens": 0, "hidden": HIDDEN, "dtype": 7, "grid": [1]}), "dtype|7"),
    ],
)
def test_invalid_values_are_refused_with_the_reason(raw: torch.Tensor, reason: str) -> None:
    with pytest.raises(InvalidEntryError, match=reason):
        read_entry(raw, hidden=HIDDEN, dtype=torch.float32)


def test_bad_header_lengths_and_msgpack() -> None:
    too_long = struct.pack("<4sI", ENTRY_MAGIC, 1 << 20) + bytes(100)
    with pytest.raises(InvalidEntryError, match="does not fit"):
        read_entry(
            torch.frombuffer(bytearray(too_long), dtype=torch.uint8), hidden=1, dtype=torch.float32
        )
    garbage = struct.pack("<4sI", ENTRY_MAGIC, 3) + b"\xc1\xc1\xc1" + bytes(53)
    with pytest.raises(InvalidEntryError, match="msgpack"):
        read_entry(
            torch.frombuffer(bytearray(garbage), dtype=torch.uint8), hidden=1, dtype=torch.float32
        )
    ext = with_header(
        {"tokens": msgpack.ExtType(1, b"x"), "hidden": 1, "dtype": "float32", "grid": [1]}
    )
    with pytest.raises(InvalidEntryError, match="msgpack"):
        read_entry(ext, hidden=1, dtype=torch.float32)
    with pytest.raises(InvalidEntryError, match="uint8"):
        read_entry(torch.zeros(3), hidden=1, dtype=torch.float32)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_arbitrary_bytes_raise_only_invalid_entry(data: bytes, with_magic: bool) -> None:
    if with_magic:
        data = ENTRY_MAGIC + data
    try:
        entry = read_entry(
            torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8),
            hidden=2,
            dtype=torch.float16,
        )
    except InvalidEntryError:
        return
    assert entry.rows.shape == (entry.tokens, 2)
