"""How one item's embedding is stored in the global tier: a small header, then raw rows.

Layout of a stored value (no pickle; nothing is executed or constructed from it but plain
values)::

    0       4        8                      payload_offset
    | EDC\\x01 | u32 n | msgpack header (n B) | zero padding | rows: tokens x hidden x itemsize |

``payload_offset`` is ``8 + n`` rounded up to a multiple of 64, so the rows can be viewed in
place as any dtype. The header is a msgpack map with exactly ``tokens``, ``hidden``,
``dtype`` and ``grid`` (decoded strictly by msgspec). A value is valid only if every field
checks out *and* its size is exactly ``payload_offset + tokens x hidden x itemsize``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec
import torch

from .. import _strict
from ..transfer import dtype_name

__all__ = [
    "ENTRY_MAGIC",
    "MAX_ENTRY_HEADER",
    "CachedItem",
    "InvalidEntryError",
    "entry_header",
    "read_entry",
]

#: "EDC" and the format version (1).
ENTRY_MAGIC: Final = b"EDC\x01"
#: Longest msgpack header accepted; real ones are a few dozen bytes.
MAX_ENTRY_HEADER: Final = 1024
_PREFIX: Final = struct.Struct("<4sI")
_ALIGN: Final = 64
_MAX_GRID_DIMS: Final = 8
_Count = Annotated[int, msgspec.Meta(ge=0)]


class InvalidEntryError(ValueError):
    """A stored value is not a valid entry for this model (wrong size, header or format)."""


@dataclass(frozen=True, slots=True, eq=False)
class CachedItem:
    """One item's embedding and layout, as the tiers hand it around.

    ``rows`` is ``[tokens, hidden]``; it may be a view into a larger buffer.
    """

    rows: torch.Tensor
    tokens: int
    grid: tuple[int, ...]


class _Header(_strict.Message, frozen=True):
    tokens: _Count
    hidden: _Count
    dtype: str
    grid: Annotated[tuple[_Count, ...], msgspec.Meta(min_length=1, max_length=_MAX_GRID_DIMS)]


_DECODER: Final = msgspec.msgpack.Decoder(_Header, ext_hook=_strict.reject_ext)


def _payload_offset(header_len: int) -> int:
    return -(-(_PREFIX.size + header_len) // _ALIGN) * _ALIGN


def entry_header(tokens: int, hidden: int, dtype: torch.dtype, grid: Sequence[int]) -> bytes:
    """The bytes stored in front of an item's rows (prefix, msgpack header, padding)."""
    header = _Header(int(tokens), int(hidden), dtype_name(dtype), tuple(int(v) for v in grid))
    packed = msgspec.msgpack.encode(header)
    offset = _payload_offset(len(packed))
    prefix = _PREFIX.pack(ENTRY_MAGIC, len(packed))
    return prefix + packed + bytes(offset - len(prefix) - len(packed))


def read_entry(raw: torch.Tensor, *, hidden: int, dtype: torch.dtype) -> CachedItem:
    """Check a fetched value (a 1-D uint8 CPU tensor) and view its rows in place.

    Does not block for long (no I/O, no copy of the rows).

    :raises InvalidEntryError: saying what is wrong: a bad prefix, header or field, another
        model's width or dtype, or a size that does not match the header.
    """
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise InvalidEntryError("a fetched value must be a 1-D uint8 tensor")
    size = int(raw.numel())
    if size < _PREFIX.size:
        raise InvalidEntryError(f"value is {size} bytes, shorter than the entry prefix")
    magic, header_len = _PREFIX.unpack(raw[: _PREFIX.size].numpy().tobytes())
    if magic != ENTRY_MAGIC:
        raise InvalidEntryError(f"value does not start with the entry magic (found {magic!r})")
    if header_len > MAX_ENTRY_HEADER or _PREFIX.size + header_len > size:
        raise InvalidEntryError(
            f"entry header length {header_len} does not fit a {size}-byte value"
        )
    packed = raw[_PREFIX.size : _PREFIX.size + header_len].numpy().tobytes()
    header = _strict.decode(_DECODER, packed, "entry header", InvalidEntryError)
    tokens, width, name = header.tokens, header.hidden, header.dtype
    if width != hidden or name != dtype_name(dtype):
        raise InvalidEntryError(
            f"entry holds {width}-wide {name!r} rows; this model makes {hidden}-wide "
            f"{dtype_name(dtype)!r} rows"
        )
    offset = _payload_offset(header_len)
    expected = offset + tokens * hidden * dtype.itemsize
    if size != expected:
        raise InvalidEntryError(
            f"entry is {size} bytes; its header ({tokens} tokens x {hidden} x "
            f"{dtype.itemsize} B) needs {expected}"
        )
    rows = raw[offset:].view(dtype).view(tokens, hidden)
    return CachedItem(rows=rows, tokens=tokens, grid=header.grid)
