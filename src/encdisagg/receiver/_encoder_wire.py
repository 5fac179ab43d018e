"""The bodies of the HTTP calls a receiver makes to an encoder.

- ``/encode``: the request's items as JSON (:func:`wire_items`), and the encoder's answer,
  decoded strictly into a frozen :class:`PartMetadata`;
- ``/send``: where the encoder delivers a part, per transport (:data:`SendTarget`).
"""

# No ``from __future__ import annotations``: msgspec reads PartMetadata's annotations as
# objects, since the package re-homes the class (``__module__``) where those names are unknown.

import base64
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Self

import msgspec

from .._errors import BadRequestError
from .._video_timing import VideoTiming, timing_from_wire

__all__ = [
    "MooncakeSendTarget",
    "PartMetadata",
    "SendTarget",
    "ZmqSendTarget",
    "engine_address",
    "needs_conversion",
    "wire_items",
]

_DATA_URL_PREFIX: Final = "data:application/octet-stream;base64,"

# -- the /encode body's items -----------------------------------------------------------------
# The in-process encoder takes raw bytes, file paths, PIL images, frame lists and {"frames",
# "fps"} maps beside the strings (data URLs, base64, URLs, server-side paths) and {"url",
# "content_hash"} maps the HTTP body takes. Bytes, paths and images are local to the caller,
# so they travel as base64 data URLs: a Path is read here, on the caller's machine, where a
# string stays a string for the server to resolve.


def needs_conversion(items: Sequence[object]) -> bool:
    """Whether any item must be turned into JSON first (and may block doing so)."""
    return not all(isinstance(item, str) for item in items)


def wire_items(items: Sequence[object]) -> list[object]:
    """The items as the ``mm_items`` of an ``/encode`` body. Blocks on file reads and image
    encoding; call it in a worker thread when :func:`needs_conversion` says so.

    :raises BadRequestError: naming ``mm_items[i]`` for an item that cannot travel over
        HTTP (a NumPy waveform: send its encoded audio instead) or an unreadable path.
    """
    return [_wire_item(item, f"mm_items[{index}]") for index, item in enumerate(items)]


def _wire_item(item: object, label: str) -> object:
    if isinstance(item, str):
        return item
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _data_url(bytes(item))
    if isinstance(item, Path):
        try:
            return _data_url(item.read_bytes())
        except OSError as exc:
            raise BadRequestError(f"{label}: cannot read {str(item)!r}: {exc}") from None
    if isinstance(item, (list, tuple)):
        return [_wire_item(frame, f"{label}[{number}]") for number, frame in enumerate(item)]
    if isinstance(item, dict):
        return {
            key: (_wire_item(value, f"{label}.frames") if key == "frames" else value)
            for key, value in item.items()
        }
    from PIL import Image  # deferred: only callers that pass images pay for the import

    if isinstance(item, Image.Image):
        out = io.BytesIO()
        item.save(out, format="PNG")  # lossless
        return _data_url(out.getvalue())
    if type(item).__module__ == "numpy":
        raise BadRequestError(
            f"{label}: a NumPy waveform cannot be sent to an encoder server (its sampling "
            "rate is not known here); send the encoded audio (WAV, FLAC, OGG, MP3) instead"
        )
    raise BadRequestError(f"{label}: unsupported item type {type(item).__name__}")


def _data_url(data: bytes) -> str:
    return _DATA_URL_PREFIX + base64.b64encode(data).decode("ascii")


# -- the /encode answer -----------------------------------------------------------------------

#: Counts and sizes: JSON integers >= 0 (``true`` is no 1: msgspec never takes a bool as int).
_Count = Annotated[int, msgspec.Meta(ge=0)]
#: Where msgspec says a wrong value is: ``- at `$.grid[1]```.
_AT_FIELD: Final = re.compile(r" - at `\$\.(\w+)")


class PartMetadata(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The size and layout of one encoded part, as its encoder reported it.

    Built with :meth:`from_json`, which rejects unknown fields and wrong types, naming the
    field.
    """

    req_id: Annotated[str, msgspec.Meta(min_length=1)]
    part_idx: _Count
    #: Bytes of the embedding.
    embedding_size: _Count
    #: Tokens (rows) of the embedding.
    embedding_len: _Count
    #: Width of the embedding (the language model's hidden size).
    embedding_dim: Annotated[int, msgspec.Meta(ge=1)]
    #: Tokens per item.
    token_counts: tuple[_Count, ...]
    #: Grid per item (``(t, h, w)`` for Qwen-family models).
    grid: tuple[tuple[_Count, ...], ...]
    #: Video parts: each item's fps, second_per_grid_ts and timestamps (optional: encoders
    #: that predate it, parts it does not apply to).
    video_timing: tuple[VideoTiming, ...] | None = None

    def __post_init__(self) -> None:
        if sum(self.token_counts) != self.embedding_len:
            raise BadRequestError(
                f"/encode answer of {self.req_id!r}: token_counts sum to "
                f"{sum(self.token_counts)}, but embedding_len is {self.embedding_len}",
                req_id=self.req_id,
            )
        if len(self.grid) != len(self.token_counts):
            raise BadRequestError(
                f"/encode answer of {self.req_id!r}: {len(self.grid)} grids for "
                f"{len(self.token_counts)} items",
                req_id=self.req_id,
            )

    @classmethod
    def from_json(cls, data: object) -> Self:
        """Validate a decoded JSON answer.

        :raises BadRequestError: for a non-object, unknown or missing fields, wrong types or
            inconsistent sizes; the message names the field.
        """
        if not isinstance(data, Mapping):
            raise BadRequestError(
                f"/encode answer must be a JSON object; got {type(data).__name__}"
            )
        req_id = data.get("req_id")
        rid = req_id if isinstance(req_id, str) and req_id else None
        fields = dict(data)
        # Video timing has its own wire rules, shared with the push header.
        timing = fields.pop("video_timing", None)
        try:
            metadata = msgspec.convert(fields, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise BadRequestError(_refusal(str(exc)), req_id=rid) from None
        if timing is None:
            return metadata
        try:
            return msgspec.structs.replace(metadata, video_timing=timing_from_wire(timing))
        except BadRequestError as exc:
            raise BadRequestError(f"/encode answer: {exc.message}", req_id=rid) from None


def _refusal(text: str) -> str:
    """msgspec's refusal of an answer, naming the field (``'part_idx'``)."""
    at = _AT_FIELD.search(text)
    if at is not None:
        return f"/encode answer field {at.group(1)!r}: {text}"
    # The answer's own keys: "Object missing required field `grid`", "... unknown field ...".
    text = text.replace("Object missing required", "is missing")
    return "/encode answer " + text.replace("Object contains unknown", "has unknown")


# -- the /send body ---------------------------------------------------------------------------


def engine_address(session_id: str) -> tuple[str, int]:
    """The host and port of a transfer engine's session id (``"host:port"``; port 0 if it
    names none)."""
    host, _, port = session_id.rpartition(":")
    return host or session_id, int(port) if port.isdigit() else 0


@dataclass(frozen=True, slots=True)
class ZmqSendTarget:
    """``/send`` body for a ZMQ delivery: the receiver's PULL endpoint."""

    receive_url: str

    def body(self, req_id: str) -> dict[str, Any]:
        return {"req_id": req_id, "receive_url": self.receive_url}


@dataclass(frozen=True, slots=True)
class MooncakeSendTarget:
    """``/send`` body for a Mooncake delivery: where in the receiver's registered memory the
    encoder writes, and which engine session owns it."""

    session_id: str
    buffer_address: int
    prefill_host: str
    embedding_port: int

    def body(self, req_id: str) -> dict[str, Any]:
        return {"req_id": req_id, **asdict(self)}


SendTarget = ZmqSendTarget | MooncakeSendTarget
