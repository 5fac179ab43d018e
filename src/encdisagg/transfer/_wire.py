"""The embedding push wire format: a msgpack header frame, then the raw tensor bytes.

The header is decoded by msgspec from the bytes straight to a strict message (see
:mod:`encdisagg._strict`), then checked as a whole by :class:`EmbeddingHeader`, whose
construction applies the same field rules to headers built here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Mapping
from typing import Annotated, Any, Final

import msgspec
import torch

from .. import _strict
from .._errors import BadRequestError
from .._modality import Modality
from .._tracing import MAX_TRACEPARENT_CHARS
from .._video_timing import VideoTiming, check_video_timing, timing_from_wire, timing_to_wire
from ._layout import EmbeddingLayout, bad_field as _bad

__all__ = [
    "WIRE_VERSION",
    "MAX_HEADER_BYTES",
    "EmbeddingHeader",
    "ForeignHeader",
    "encode_header",
    "decode_header",
    "payload_nbytes",
    "check_payload",
    "header_frame",
    "payload_view",
    "tensor_from_frame",
    "dtype_name",
    "torch_dtype",
]

WIRE_VERSION: Final = 1

#: Header frames longer than this are rejected before msgpack sees them.
MAX_HEADER_BYTES: Final = 1 << 20

_DTYPES: Final[Mapping[str, torch.dtype]] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_NAMES: Final[Mapping[torch.dtype, str]] = {dtype: name for name, dtype in _DTYPES.items()}
_MODALITIES: Final = frozenset(m.value for m in Modality)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``: ``torch.float16`` → ``"float16"``.

    :raises BadRequestError: for a dtype the wire format does not carry.
    """
    try:
        return _NAMES[dtype]
    except KeyError:
        raise BadRequestError(
            f"dtype {dtype} cannot be sent; use one of {', '.join(_DTYPES)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name: ``"float16"`` → ``torch.float16``.

    :raises BadRequestError: for an unknown name.
    """
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise _bad("dtype", f"one of {', '.join(_DTYPES)}", name) from None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddingHeader:
    """Frame 0 of an embedding push (DESIGN §5.2); validated on construction.

    A data part describes the C-contiguous ``shape`` tensor of ``dtype`` in frame 1. An error
    part carries ``error`` and ``status`` together and has no frame 1.

    :raises BadRequestError: naming the first invalid field.
    """

    v: int = WIRE_VERSION
    req_id: str
    num_parts: int
    part_idx: int
    modality: str
    shape: tuple[int, int]
    dtype: str
    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]
    error: str | None = None
    status: int | None = None
    # Optional (video timing): each video item's fps, second_per_grid_ts and timestamps,
    # as the model's video processor computes them; absent for other parts.
    video_timing: tuple[VideoTiming, ...] | None = None
    # Optional (qwen3-vl): the named column sections of a data part's embedding, e.g. the
    # main embedding then Qwen3-VL's deepstack feature maps; absent means one section.
    layout: EmbeddingLayout | None = None
    # Optional (tracing): the W3C traceparent of the transfer that sent this part, so the
    # receiver's spans join the encoder's trace; absent when nobody traces.
    traceparent: str | None = None

    def __post_init__(self) -> None:
        _check_version(self.v)
        # Types and bounds are the wire's (one schema for both ways in); tuples keep the
        # header hashable and equal to its decoded self.
        _strict.convert(self, _Wire, _WHAT, _refused, from_attributes=True)
        for name in ("shape", "token_counts", "grid"):
            if type(getattr(self, name)) is not tuple:
                raise _bad(name, "a tuple", getattr(self, name))
        if not all(type(row) is tuple for row in self.grid):
            raise _bad("grid", "a tuple of tuples", self.grid)
        if self.part_idx >= self.num_parts:
            raise _bad("part_idx", f"in [0, num_parts={self.num_parts})", self.part_idx)
        if self.modality not in _MODALITIES:
            raise _bad("modality", f"one of {', '.join(sorted(_MODALITIES))}", self.modality)
        torch_dtype(self.dtype)
        if (self.error is None) != (self.status is None):
            raise BadRequestError(
                "embedding header fields 'error' and 'status' must be given together",
                req_id=self.req_id,
            )
        if self.error is None and sum(self.token_counts) != self.shape[0]:
            raise BadRequestError(
                f"embedding header of req_id {self.req_id!r}: token_counts sum to "
                f"{sum(self.token_counts)}, but shape has {self.shape[0]} tokens",
                req_id=self.req_id,
            )
        self._check_video_timing()
        self._check_layout()

    def _check_layout(self) -> None:
        # The layout describes a payload: an error part has none, and the columns must add
        # up to the payload's width.
        if self.layout is None:
            return
        if not isinstance(self.layout, EmbeddingLayout):
            raise _bad("layout", "an EmbeddingLayout", self.layout)
        if self.error is not None:
            raise BadRequestError(
                "embedding header field 'layout' is not allowed in an error part",
                req_id=self.req_id,
            )
        if self.layout.width != self.shape[1]:
            raise BadRequestError(
                f"embedding header of req_id {self.req_id!r}: layout has {self.layout.width} "
                f"columns, but shape is {self.shape[1]} wide",
                req_id=self.req_id,
            )

    def _check_video_timing(self) -> None:
        # Timing belongs to a video part's items: one entry per grid row, each numbering
        # that row's temporal steps (see encdisagg._video_timing).
        timings = self.video_timing
        if timings is None:
            return
        if type(timings) is not tuple or not all(isinstance(t, VideoTiming) for t in timings):
            raise _bad("video_timing", "a tuple of VideoTiming", timings)
        if self.error is not None:
            raise BadRequestError(
                "embedding header field 'video_timing' is not allowed in an error part",
                req_id=self.req_id,
            )
        check_video_timing(
            timings,
            modality=self.modality,
            grid=self.grid,
            where=f"embedding header of req_id {self.req_id!r}",
            req_id=self.req_id,
        )

    @property
    def is_error(self) -> bool:
        """Whether this is an error part (no payload frame)."""
        return self.error is not None


@dataclasses.dataclass(frozen=True, slots=True)
class ForeignHeader:
    """A header frame written for another receiver (SGLang's pickled ``EmbeddingData``),
    pushed as is in place of ours; ``req_id`` and ``part_idx`` name the message in errors."""

    req_id: str
    part_idx: int
    frame: bytes


_WHAT: Final = "embedding header"
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Text = Annotated[str, msgspec.Meta(min_length=1)]
# Only its shape is checked: what it says is the tracer's business, and a malformed one only
# starts a new trace there.
_Traceparent = Annotated[
    str,
    msgspec.Meta(
        max_length=MAX_TRACEPARENT_CHARS,
        pattern=_strict.pattern(r"^[\x20-\x7e]+\Z", "printable ASCII characters"),
    ),
]


class _Wire(_strict.Message, frozen=True, kw_only=True, omit_defaults=True):
    """The header map as it travels, in field order; ``layout`` and ``video_timing`` are
    their wire values here (parsed by their own types)."""

    v: int
    req_id: _Text
    num_parts: Annotated[int, msgspec.Meta(ge=1)]
    part_idx: _Count
    modality: str
    shape: tuple[_Count, _Count]
    dtype: str
    token_counts: tuple[_Count, ...]
    grid: tuple[tuple[_Count, ...], ...]
    error: _Text | None = None
    status: Annotated[int, msgspec.Meta(ge=400, le=599)] | None = None
    video_timing: Any = None
    layout: Any = None
    traceparent: _Traceparent | None = None


class _Version(msgspec.Struct):
    """Only the version of a refused header (other fields ignored): see :func:`decode_header`."""

    v: Any = WIRE_VERSION


_DECODER: Final = msgspec.msgpack.Decoder(_Wire, ext_hook=_strict.reject_ext)
_VERSION: Final = msgspec.msgpack.Decoder(_Version, ext_hook=_strict.reject_ext)
_NAME: Final = re.compile(r"[a-z_]+")


def _check_version(v: object) -> None:
    if type(v) is not int or v != WIRE_VERSION:
        raise _bad("v", f"{WIRE_VERSION} (the only wire version)", v)


def _refused(message: str) -> BadRequestError:
    """A refusal worded as the header's other checks word theirs: ``embedding header field
    'grid'[0] must be ...``."""
    name = _NAME.match(message)
    if name is not None and name[0] in _Wire.__struct_fields__:
        message = f"{_WHAT} field {name[0]!r}{message[name.end() :]}"
    elif _WHAT not in message:
        message = f"{_WHAT}: {message}"
    return BadRequestError(message)


def encode_header(header: EmbeddingHeader) -> bytes:
    """Frame 0 for ``header``: a msgpack map; ``error``/``status`` only for an error part,
    and each optional field only when given."""
    timing, layout = header.video_timing, header.layout
    wire = msgspec.structs.replace(
        msgspec.convert(header, _Wire, from_attributes=True),
        video_timing=None if timing is None else timing_to_wire(timing),
        layout=None if layout is None else layout.to_wire(),
    )
    return msgspec.msgpack.encode(wire)


def decode_header(data: bytes | bytearray | memoryview) -> EmbeddingHeader:
    """Parse and validate frame 0. Never unpickles, never builds anything but plain values.

    :raises BadRequestError: for anything but a valid header: undecodable msgpack, trailing
        bytes, extension types, a non-map, missing or unknown fields, wrong types (bools are
        not ints), negative sizes, ``part_idx`` outside ``[0, num_parts)``, an unknown dtype
        or modality, or a wrong version; the message names the field.
    """
    if len(data) > MAX_HEADER_BYTES:
        raise BadRequestError(
            f"embedding header is {len(data)} bytes; the limit is {MAX_HEADER_BYTES}"
        )
    try:
        wire = _strict.decode(_DECODER, data, _WHAT, _refused)
    except BadRequestError:
        # A newer version may legitimately differ in any field: that is the news to tell.
        with contextlib.suppress(msgspec.DecodeError, ValueError, RecursionError):
            _check_version(_VERSION.decode(data).v)
        raise
    fields = msgspec.structs.asdict(wire)
    if wire.layout is not None:
        fields["layout"] = EmbeddingLayout.from_wire(wire.layout)
    if wire.video_timing is not None:
        fields["video_timing"] = timing_from_wire(
            wire.video_timing, field="embedding header field 'video_timing'"
        )
    return EmbeddingHeader(**fields)


def payload_nbytes(header: EmbeddingHeader) -> int:
    """The byte length of the payload frame ``header`` describes (0 for an error part)."""
    if header.error is not None:
        return 0
    tokens, hidden = header.shape
    return tokens * hidden * _DTYPES[header.dtype].itemsize


def payload_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of ``tensor`` to send as the payload frame.

    The view keeps ``tensor``'s memory alive while it is referenced (also by ZMQ).

    :raises BadRequestError: if ``tensor`` is not a C-contiguous CPU tensor of a wire dtype.
    """
    dtype_name(tensor.dtype)
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise BadRequestError(
            f"payload must be a C-contiguous CPU tensor; got device={tensor.device}, "
            f"contiguous={tensor.is_contiguous()}"
        )
    # Through uint8 because numpy has no bfloat16; reshape(-1) of a contiguous tensor is a view.
    # (numpy arrays export the buffer protocol; numpy's stubs do not say so.)
    array: Any = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def tensor_from_frame(
    header: EmbeddingHeader, buffer: bytes | bytearray | memoryview
) -> torch.Tensor:
    """The ``header.shape`` tensor over ``buffer``, zero-copy when ``buffer`` is writable.

    A read-only buffer (``bytes``) is copied once, since torch only shares writable memory.

    :raises BadRequestError: for an error part, or if ``len(buffer)`` differs from
        ``shape x itemsize``.
    """
    if header.error is not None:
        raise BadRequestError(
            f"req_id {header.req_id!r} part {header.part_idx} is an error part; it has no payload",
            req_id=header.req_id,
        )
    try:
        view = memoryview(buffer).cast("B")
    except TypeError:
        raise BadRequestError(
            f"payload of req_id {header.req_id!r} part {header.part_idx} is not contiguous",
            req_id=header.req_id,
        ) from None
    check_payload(header, view)
    dtype = _DTYPES[header.dtype]
    if view.nbytes == 0:
        return torch.empty(header.shape, dtype=dtype)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=dtype).view(header.shape)


def check_payload(header: EmbeddingHeader, payload: memoryview | None) -> None:
    """:raises BadRequestError: ``payload`` does not fit ``header`` (missing, present for an
    error part, not C-contiguous, or not ``payload_nbytes(header)`` long)."""
    where = f"req_id {header.req_id!r} part {header.part_idx}"
    if header.error is not None:
        if payload is not None:
            raise BadRequestError(f"error part of {where} carries a payload", req_id=header.req_id)
        return
    if payload is None:
        raise BadRequestError(f"payload of {where} is missing", req_id=header.req_id)
    if not payload.c_contiguous:
        raise BadRequestError(f"payload of {where} is not C-contiguous", req_id=header.req_id)
    if payload.nbytes != payload_nbytes(header):
        raise BadRequestError(
            f"payload of {where} is {payload.nbytes} bytes; shape {list(header.shape)} of "
            f"{header.dtype} needs {payload_nbytes(header)}",
            req_id=header.req_id,
        )


def header_frame(header: EmbeddingHeader | ForeignHeader, payload: memoryview | None) -> bytes:
    """Frame 0 of a push of ``payload``: ours, checked against ``payload`` (as
    :func:`check_payload`), or a foreign one as given. Not async."""
    if isinstance(header, ForeignHeader):
        return header.frame
    check_payload(header, payload)
    return encode_header(header)
