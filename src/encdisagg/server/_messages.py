"""Request bodies of the encoder routes, decoded strictly into frozen message types.

The same types travel between the data-parallel front and its workers (as msgpack maps), so
one decoder guards both edges. Every decoder rejects unknown fields, missing required fields
and wrongly typed values with a :class:`~encdisagg.BadRequestError` that names the field (and
carries the ``req_id`` once it is known). Booleans are never accepted as integers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Self

from .._errors import BadRequestError
from .._modality import Modality
from .._video_timing import VideoTiming, timing_from_wire, timing_to_wire
from ..encoder import (
    Destination,
    EncodeRequest,
    EncodeResult,
    MooncakeDestination,
    ZmqDestination,
)
from ..encoder._types import SglangZmqDestination
from ._fields import MAX_TEXT_CHARS, Fields, type_name, zmq_url
from ._json import INT_MAX

__all__ = [
    "MAX_PUSH_URLS",
    "EncodeBody",
    "MetadataBody",
    "ReceiveUrlBody",
    "ReleaseBody",
    "SendBody",
    "result_from_wire",
    "result_json",
    "result_to_wire",
]

#: Most receivers one ``/scheduler_receive_url`` may name (each gets its own push).
MAX_PUSH_URLS: Final = 64

# --- /encode ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncodeBody:
    """``POST /encode``: one part of a multimodal request."""

    req_id: str
    mm_items: tuple[str | Mapping[str, Any], ...]
    modality: str = "image"
    num_parts: int = 1
    part_idx: int = 0
    hashes: tuple[str, ...] | None = None

    _FIELDS = frozenset({"req_id", "mm_items", "modality", "num_parts", "part_idx", "hashes"})

    @classmethod
    def from_json(cls, body: object) -> Self:
        """:raises BadRequestError: naming the first invalid field."""
        fields = Fields(body, cls._FIELDS, "/encode")
        req_id = fields.req_id_field()
        raw_items = fields.raw("mm_items", required=True)
        if not isinstance(raw_items, (list, tuple)):
            raise fields.error(f"mm_items must be a list, got {type_name(raw_items)}")
        if not raw_items:
            raise fields.error("mm_items must not be empty")
        items: list[str | Mapping[str, Any]] = []
        for index, item in enumerate(raw_items):
            if isinstance(item, str) and item:
                items.append(item)
            elif isinstance(item, Mapping) and all(isinstance(key, str) for key in item):
                items.append(dict(item))
            else:
                raise fields.error(
                    f"mm_items[{index}] must be a non-empty string (data URL, base64 or URL) "
                    f"or an object with 'url', got {type_name(item)}"
                )
        modality = fields.text("modality", required=False, max_chars=32) or "image"
        try:
            Modality.parse(modality)
        except BadRequestError as exc:
            raise fields.error(exc.message) from None
        num_parts = fields.integer("num_parts", required=False, minimum=1)
        num_parts = 1 if num_parts is None else num_parts
        part_idx = fields.integer("part_idx", required=False, minimum=0)
        part_idx = 0 if part_idx is None else part_idx
        if part_idx >= num_parts:
            raise fields.error(f"part_idx must be in [0, {num_parts}); got {part_idx}")
        hashes: tuple[str, ...] | None = None
        raw_hashes = fields.raw("hashes", required=False)
        if raw_hashes is not None:
            if not isinstance(raw_hashes, (list, tuple)):
                raise fields.error(f"hashes must be a list of strings, got {type_name(raw_hashes)}")
            for index, value in enumerate(raw_hashes):
                if not isinstance(value, str) or not value or len(value) > MAX_TEXT_CHARS:
                    raise fields.error(
                        f"hashes[{index}] must be a non-empty string of at most "
                        f"{MAX_TEXT_CHARS} characters, got {type_name(value)}"
                    )
            if len(raw_hashes) != len(items):
                raise fields.error(
                    f"hashes has {len(raw_hashes)} entries but mm_items has {len(items)}"
                )
            hashes = tuple(raw_hashes)
        return cls(req_id, tuple(items), modality, num_parts, part_idx, hashes)

    def to_request(self) -> EncodeRequest:
        """The Encoder's request for this body."""
        return EncodeRequest(
            self.req_id,
            list(self.mm_items),
            modality=self.modality,
            num_parts=self.num_parts,
            part_idx=self.part_idx,
            hashes=self.hashes,
        )

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "req_id": self.req_id,
            "mm_items": list(self.mm_items),
            "modality": self.modality,
            "num_parts": self.num_parts,
            "part_idx": self.part_idx,
        }
        if self.hashes is not None:
            wire["hashes"] = list(self.hashes)
        return wire


# --- /send -----------------------------------------------------------------------------------

_MOONCAKE_FIELDS = ("session_id", "buffer_address", "prefill_host", "embedding_port")


@dataclass(frozen=True, slots=True)
class SendBody:
    """``POST /send``: deliver a staged embedding to one destination.

    Either ``receive_url`` (ZMQ) or all of ``session_id``, ``buffer_address``,
    ``prefill_host`` and ``embedding_port`` (Mooncake). The metadata SGLang's receivers echo
    back (``part_idx``, ``embedding_size``, ``embedding_len``, ``embedding_dim``) is accepted
    and checked for type, but not used.
    """

    req_id: str
    destination: Destination
    receive_count: int | None = None

    _FIELDS = frozenset(
        {
            "req_id",
            "receive_url",
            *_MOONCAKE_FIELDS,
            "receive_count",
            "part_idx",
            "embedding_size",
            "embedding_len",
            "embedding_dim",
        }
    )

    @classmethod
    def from_json(cls, body: object, *, internal: bool = False) -> Self:
        """:param internal: the data-parallel front's map, which may also carry the header
            frame of a ZMQ push (``sglang_header``, SGLang's); ``POST /send`` refuses it as
            an unknown field.

        :raises BadRequestError: naming the first invalid field.
        """
        allowed = cls._FIELDS | {"sglang_header"} if internal else cls._FIELDS
        fields = Fields(body, allowed, "/send")
        req_id = fields.req_id_field()
        for name in ("part_idx", "embedding_size", "embedding_len", "embedding_dim"):
            fields.integer(name, required=False, minimum=0)
        receive_count = fields.integer("receive_count", required=False, minimum=1)
        mooncake_given = [name for name in _MOONCAKE_FIELDS if fields.has(name)]
        destination: Destination
        if fields.has("receive_url"):
            if mooncake_given:
                raise fields.error(
                    f"give either receive_url (ZMQ) or the Mooncake fields, not both "
                    f"(got receive_url and {mooncake_given[0]})"
                )
            url = fields.text("receive_url")
            assert url is not None
            destination = _zmq_destination(fields, "receive_url", url)
            header = fields.raw("sglang_header", required=False)
            if header is not None:
                if not isinstance(header, bytes):
                    raise fields.error(f"sglang_header must be bytes, got {type_name(header)}")
                destination = SglangZmqDestination(destination.url, header)
        elif mooncake_given:
            session_id = fields.identifier("session_id")
            # A registered address is a 64-bit pointer; anything larger no engine can take.
            address = fields.integer("buffer_address", minimum=1, maximum=INT_MAX)
            host = fields.identifier("prefill_host")
            port = fields.integer("embedding_port", minimum=1, maximum=65535)
            assert address is not None
            destination = MooncakeDestination(session_id, address, f"{host}:{port}")
        else:
            raise fields.error(
                "missing field 'receive_url' (ZMQ), or 'session_id', 'buffer_address', "
                "'prefill_host' and 'embedding_port' (Mooncake)"
            )
        return cls(req_id, destination, receive_count)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"req_id": self.req_id}
        destination = self.destination
        if isinstance(destination, ZmqDestination):
            wire["receive_url"] = destination.url
            if isinstance(destination, SglangZmqDestination):
                wire["sglang_header"] = destination.header
        else:
            host, _, port = destination.endpoint.rpartition(":")
            wire.update(
                session_id=destination.session_id,
                buffer_address=destination.buffer_address,
                prefill_host=host,
                embedding_port=int(port),
            )
        if self.receive_count is not None:
            wire["receive_count"] = self.receive_count
        return wire


def _zmq_destination(fields: Fields, name: str, url: str) -> ZmqDestination:
    try:
        return ZmqDestination(zmq_url(name, url))
    except BadRequestError as exc:
        raise fields.error(exc.message) from None


# --- /scheduler_receive_url ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReceiveUrlBody:
    """``POST /scheduler_receive_url``: push mode; the encoder pushes to each URL once staged.

    ``receive_url`` is one URL or a list; ``"host:port"`` means ``"tcp://host:port"``.
    ``modality`` (sent by SGLang's receivers) is accepted and checked, but not used.
    """

    req_id: str
    receive_count: int
    receive_urls: tuple[str, ...]

    _FIELDS = frozenset({"req_id", "receive_count", "receive_url", "modality"})

    @classmethod
    def from_json(cls, body: object) -> Self:
        """:raises BadRequestError: naming the first invalid field."""
        fields = Fields(body, cls._FIELDS, "/scheduler_receive_url")
        req_id = fields.req_id_field()
        receive_count = fields.integer("receive_count", minimum=1)
        assert receive_count is not None
        modality = fields.text("modality", required=False, max_chars=32)
        if modality is not None:
            try:
                Modality.parse(modality)
            except BadRequestError as exc:
                raise fields.error(exc.message) from None
        raw = fields.raw("receive_url", required=True)
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise fields.error(
                f"receive_url must be a URL or a non-empty list of URLs, got {type_name(raw)}"
            )
        if len(raw) > MAX_PUSH_URLS:
            raise fields.error(f"receive_url lists {len(raw)} URLs; at most {MAX_PUSH_URLS}")
        urls: list[str] = []
        for index, value in enumerate(raw):
            name = f"receive_url[{index}]"
            if not isinstance(value, str) or not value:
                raise fields.error(f"{name} must be a non-empty string, got {type_name(value)}")
            url = _zmq_destination(fields, name, value).url
            if url not in urls:
                urls.append(url)
        return cls(req_id, receive_count, tuple(urls))

    def to_wire(self) -> dict[str, Any]:
        return {
            "req_id": self.req_id,
            "receive_count": self.receive_count,
            "receive_url": list(self.receive_urls),
        }


# --- /scheduler_receive_meta_data and /release -------------------------------------------------


@dataclass(frozen=True, slots=True)
class MetadataBody:
    """``POST /scheduler_receive_meta_data``: wait for a part's embedding metadata."""

    req_id: str
    part_idx: int

    _FIELDS = frozenset({"req_id", "part_idx"})

    @classmethod
    def from_json(cls, body: object) -> Self:
        """:raises BadRequestError: naming the first invalid field."""
        fields = Fields(body, cls._FIELDS, "/scheduler_receive_meta_data")
        req_id = fields.req_id_field()
        part_idx = fields.integer("part_idx", minimum=0)
        assert part_idx is not None
        return cls(req_id, part_idx)

    def to_wire(self) -> dict[str, Any]:
        return {"req_id": self.req_id, "part_idx": self.part_idx}


@dataclass(frozen=True, slots=True)
class ReleaseBody:
    """``POST /release``: release a request's staged embedding."""

    req_id: str

    _FIELDS = frozenset({"req_id"})

    @classmethod
    def from_json(cls, body: object) -> Self:
        """:raises BadRequestError: naming the first invalid field."""
        return cls(Fields(body, cls._FIELDS, "/release").req_id_field())

    def to_wire(self) -> dict[str, Any]:
        return {"req_id": self.req_id}


# --- results ---------------------------------------------------------------------------------


def result_json(result: EncodeResult, part_idx: int) -> dict[str, Any]:
    """The answer of ``/encode`` and ``/scheduler_receive_meta_data`` (SGLang's names)."""
    return {
        "req_id": result.req_id,
        "part_idx": part_idx,
        "embedding_size": result.nbytes,
        "embedding_len": result.num_tokens,
        "embedding_dim": result.hidden_size,
        "token_counts": list(result.token_counts),
        "grid": [list(row) for row in result.grid],
        **_timing_json(result),
    }


def _timing_json(result: EncodeResult) -> dict[str, Any]:
    # Only video answers carry timing: image and audio answers stay as they were.
    if result.video_timing is None:
        return {}
    return {"video_timing": timing_to_wire(result.video_timing)}


def result_to_wire(result: EncodeResult) -> dict[str, Any]:
    """An :class:`~encdisagg.EncodeResult` as a msgpack-friendly map."""
    return {
        "req_id": result.req_id,
        "num_tokens": result.num_tokens,
        "hidden_size": result.hidden_size,
        "dtype": result.dtype,
        "nbytes": result.nbytes,
        "token_counts": list(result.token_counts),
        "grid": [list(row) for row in result.grid],
        **_timing_json(result),
    }


_RESULT_FIELDS = frozenset(
    {"req_id", "num_tokens", "hidden_size", "dtype", "nbytes", "token_counts", "grid"}
    | {"video_timing"}
)


def result_from_wire(value: object) -> EncodeResult:
    """Decode :func:`result_to_wire`'s map strictly.

    :raises BadRequestError: naming the invalid field.
    """
    fields = Fields(value, _RESULT_FIELDS, "encode result")
    req_id = fields.req_id_field()
    numbers = {
        name: fields.integer(name, minimum=0) for name in ("num_tokens", "hidden_size", "nbytes")
    }
    dtype = fields.text("dtype")
    counts = fields.raw("token_counts", required=True)
    grid = fields.raw("grid", required=True)
    if not isinstance(counts, (list, tuple)) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in counts
    ):
        raise fields.error("token_counts must be a list of integers")
    if not isinstance(grid, (list, tuple)) or not all(
        isinstance(row, (list, tuple))
        and all(isinstance(n, int) and not isinstance(n, bool) for n in row)
        for row in grid
    ):
        raise fields.error("grid must be a list of lists of integers")
    assert dtype is not None
    return EncodeResult(
        req_id=req_id,
        num_tokens=numbers["num_tokens"] or 0,
        hidden_size=numbers["hidden_size"] or 0,
        dtype=dtype,
        nbytes=numbers["nbytes"] or 0,
        token_counts=tuple(counts),
        grid=tuple(tuple(row) for row in grid),
        video_timing=_timing_field(fields.raw("video_timing", required=False)),
    )


def _timing_field(value: object) -> tuple[VideoTiming, ...] | None:
    return None if value is None else timing_from_wire(value)
