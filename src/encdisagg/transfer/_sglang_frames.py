"""SGLang's embedding header frame, written by hand: a pickle we only ever *write*.

SGLang 0.5.20's receivers read frame 0 of an embedding message with ``safe_pickle_loads``
(an allow-listing unpickler) and expect an ``EmbeddingData`` object without its tensor.
This module emits that pickle opcode by opcode (protocol 2) from plain values, so it never
imports sglang and never calls ``pickle`` at all. The only globals it names are the ones
SGLang's allow-list takes: ``EmbeddingData`` itself, its ``Modality`` enum, the
``torch.<dtype>`` singletons and ``torch.tensor`` (for the grid, an int64 ``[items, 3]``
tensor as SGLang's own encoder sends it).

The object is built the way pickle builds any plain instance (``NEWOBJ`` then ``BUILD``
with its ``__dict__``): no constructor runs on the receiver. Nothing here decodes anything.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .._errors import BadRequestError
from .._modality import Modality

__all__ = ["SGLANG_DTYPES", "SglangPart", "sglang_header"]

_EMBEDDING_DATA: Final = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
_MODALITY: Final = ("sglang.srt.managers.schedule_batch", "Modality")
#: SGLang's ``Modality`` is an ``enum.auto()`` enum: these are its members' values.
_MODALITY_VALUES: Final = {Modality.IMAGE: 1, Modality.VIDEO: 2, Modality.AUDIO: 3}
#: The dtypes a header may name (as ``torch.<name>``): what an embedding can be.
SGLANG_DTYPES: Final = frozenset({"float16", "bfloat16", "float32", "float64"})

# Pickle opcodes (protocol 2); see the table at the top of CPython's Lib/pickle.py.
_PROTO: Final = b"\x80\x02"
_STOP: Final = b"."
_MARK: Final = b"("
_GLOBAL: Final = b"c"
_NEWOBJ: Final = b"\x81"
_REDUCE: Final = b"R"
_BUILD: Final = b"b"
_EMPTY_TUPLE: Final = b")"
_TUPLE1: Final = b"\x85"
_EMPTY_LIST: Final = b"]"
_APPENDS: Final = b"e"
_EMPTY_DICT: Final = b"}"
_SETITEMS: Final = b"u"
_NONE: Final = b"N"
_BININT: Final = b"J"
_LONG1: Final = b"\x8a"
_BINFLOAT: Final = b"G"
_BINUNICODE: Final = b"X"

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SglangPart:
    """What one header frame says about one part of a request.

    A successful part has ``shape``, ``dtype`` and ``grid``; an error part has
    ``error_msg`` and ``error_code`` (an HTTP status) and none of the three.

    :ivar req_id: the part's id as SGLang sent it (``{rid}_local_part_{k}``).
    :ivar grid: one ``(t, h, w)`` row per item of the part.
    :ivar shape: ``(tokens, hidden)`` of the raw bytes in frame 1 (or the Mooncake write).
    :ivar dtype: a name in :data:`SGLANG_DTYPES`.
    :ivar send_time: the sender's ``time.time()``; SGLang's receiver reads it.
    """

    req_id: str
    num_parts: int
    part_idx: int
    modality: Modality
    send_time: float
    grid: tuple[tuple[int, ...], ...] | None = None
    shape: tuple[int, int] | None = None
    dtype: str | None = None
    error_msg: str | None = None
    error_code: int | None = None
    #: Qwen3-VL's per-video timestamps (seconds of each temporal grid step), one tuple per
    #: video item of the part; ``None`` for other models and modalities.
    video_timestamps: tuple[tuple[float, ...], ...] | None = None
    #: Qwen2.5-VL's seconds per temporal grid step, one per video item (sent as a float32
    #: tensor, as SGLang's encoder does); ``None`` for other models and modalities.
    second_per_grid_ts: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.error_msg is None:
            if self.shape is None or self.dtype is None or self.grid is None:
                raise BadRequestError("an embedding part needs shape, dtype and grid")
            if self.dtype not in SGLANG_DTYPES:
                raise BadRequestError(
                    f"dtype {self.dtype!r} cannot be named in an SGLang header; "
                    f"use one of {', '.join(sorted(SGLANG_DTYPES))}"
                )
        elif self.error_code is None or not 100 <= self.error_code <= 599:
            # SGLang converts the code to an HTTPStatus in its scheduler loop.
            raise BadRequestError(f"error_code must be an HTTP status; got {self.error_code!r}")
        if not math.isfinite(self.send_time):
            raise BadRequestError("send_time must be a finite number")
        times = [t for video in self.video_timestamps or () for t in video]
        if not all(math.isfinite(t) for t in [*times, *(self.second_per_grid_ts or ())]):
            raise BadRequestError("video timing values must be finite numbers")


def sglang_header(part: SglangPart) -> bytes:
    """The pickle of SGLang's ``EmbeddingData`` for ``part``, without the tensor.

    The same frame serves a ZMQ push (frame 1, the raw bytes, follows) and a Mooncake
    completion notice (the bytes landed by RDMA; nothing follows): both carry the
    ``embedding`` key as ``None``, as SGLang's own do. Not async; pure.
    """
    state: list[tuple[str, bytes]] = [
        ("req_id", _text(part.req_id)),
        ("num_parts", _int(part.num_parts)),
        ("part_idx", _int(part.part_idx)),
        ("grid_dim", _NONE if part.grid is None else _grid(part.grid)),
        ("modality", _modality(part.modality)),
        ("embedding", _NONE),
        ("send_time", _float(part.send_time)),
        ("dtype", _NONE if part.dtype is None else _global("torch", part.dtype)),
        ("shape", _NONE if part.shape is None else _list([_int(n) for n in part.shape])),
        ("_mr_ptr", _NONE),
        ("error_msg", _NONE if part.error_msg is None else _text(part.error_msg)),
        ("error_code", _NONE if part.error_code is None else _int(part.error_code)),
    ]
    if part.error_msg is None:
        # The video fields SGLang's encoder attaches to every successful part.
        timestamps = part.video_timestamps
        seconds = part.second_per_grid_ts
        state += [
            (
                "video_timestamps",
                _NONE
                if timestamps is None
                else _list([_list([_float(t) for t in video]) for video in timestamps]),
            ),
            (
                "second_per_grid_ts",
                _NONE if seconds is None else _tensor(_list([_float(t) for t in seconds])),
            ),
        ]
    body = b"".join(_text(key) + value for key, value in state)
    return b"".join(
        [
            _PROTO,
            _global(*_EMBEDDING_DATA),
            _EMPTY_TUPLE,
            _NEWOBJ,
            _EMPTY_DICT,
            _MARK,
            body,
            _SETITEMS,
            _BUILD,
            _STOP,
        ]
    )


# --- opcodes for values ------------------------------------------------------------------


def _global(module: str, name: str) -> bytes:
    for text in (module, name):
        if not text.replace(".", "").replace("_", "").isalnum():
            raise BadRequestError(f"not a global name: {text!r}")
    return _GLOBAL + module.encode("ascii") + b"\n" + name.encode("ascii") + b"\n"


def _text(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return _BINUNICODE + struct.pack("<I", len(data)) + data


def _int(value: int) -> bytes:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"expected an integer, got {type(value).__name__}")
    if _INT32_MIN <= value <= _INT32_MAX:
        return _BININT + struct.pack("<i", value)
    length = (value.bit_length() + 8) // 8  # room for the sign bit
    return _LONG1 + bytes([length]) + value.to_bytes(length, "little", signed=True)


def _float(value: float) -> bytes:
    return _BINFLOAT + struct.pack(">d", float(value))


def _list(items: Sequence[bytes]) -> bytes:
    if not items:
        return _EMPTY_LIST
    return _EMPTY_LIST + _MARK + b"".join(items) + _APPENDS


def _modality(modality: Modality) -> bytes:
    # Modality(value): how pickle rebuilds any enum member.
    return _global(*_MODALITY) + _int(_MODALITY_VALUES[modality]) + _TUPLE1 + _REDUCE


def _grid(rows: tuple[tuple[int, ...], ...]) -> bytes:
    """``torch.tensor(rows)``: int64 ``[len(rows), width]``; ragged or empty grids stay
    lists (SGLang's receiver turns lists into tensors itself)."""
    nested = _list([_list([_int(n) for n in row]) for row in rows])
    widths = {len(row) for row in rows}
    if len(widths) != 1 or 0 in widths:
        return nested
    return _tensor(nested)


def _tensor(values: bytes) -> bytes:
    """``torch.tensor(values)``: int64 for integers, float32 (torch's default) for floats."""
    return _global("torch", "tensor") + values + _TUPLE1 + _REDUCE
