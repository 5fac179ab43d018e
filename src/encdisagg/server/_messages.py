"""Request bodies of the encoder routes, decoded strictly into frozen message types.

The same types travel between the data-parallel front and its workers (as msgpack maps), so
one decoder guards both edges. Each body is a msgspec Struct (``_strict``): unknown fields,
missing required fields and wrongly typed values are refused with a
:class:`~encdisagg.BadRequestError` that names the field (and carries the ``req_id`` once
it is known). Booleans are never accepted as integers; a ``null`` field counts as absent.
"""

# No ``from __future__ import annotations``: msgspec reads a Struct's annotations when it
# first decodes one, from the module the class names as its own, and ``encdisagg.server``
# names its public classes as its own.
from typing import Annotated, Any, ClassVar, Final, Self

import msgspec

from .._errors import BadRequestError
from .._modality import Modality
from .._strict import Message
from .._video_timing import timing_from_wire, timing_to_wire
from ..encoder import (
    Destination,
    EncodeRequest,
    EncodeResult,
    MooncakeDestination,
    ZmqDestination,
)
from ..encoder._types import SglangZmqDestination
from ._fields import (
    Count,
    Identifier,
    ModalityName,
    Port,
    Positive,
    ReqId,
    Text,
    decode_fields,
    zmq_url,
)
from ._json import INT_MAX

__all__ = [
    "MAX_PUSH_URLS",
    "EncodeBody",
    "MetadataBody",
    "ReceiveUrlBody",
    "ReleaseBody",
    "SendBody",
    "metadata_json",
    "result_from_wire",
    "result_json",
    "result_to_wire",
]

#: Most receivers one ``/scheduler_receive_url`` may name (each gets its own push).
MAX_PUSH_URLS: Final = 64


class _Body(Message, frozen=True):
    """A body decoded as it is: :meth:`from_json` and :meth:`to_wire` are each other's
    inverse."""

    _ROUTE: ClassVar[str]

    @classmethod
    def from_json(cls, body: object) -> Self:
        """Decode ``body`` (decoded JSON or msgpack). Not async.

        :raises BadRequestError: naming the first invalid field.
        """
        return decode_fields(body, cls, cls._ROUTE)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly map that :meth:`from_json` reads back."""
        wire: dict[str, Any] = msgspec.to_builtins(self)
        return wire


def _check_modality(name: str) -> None:
    if name in _MODALITY_NAMES:  # most bodies: no need to parse
        return
    try:
        Modality.parse(name)
    except BadRequestError as exc:
        raise ValueError(exc.message) from None


_MODALITY_NAMES: Final = frozenset(m.value for m in Modality)


# --- /encode ---------------------------------------------------------------------------------


class EncodeBody(_Body, frozen=True):
    """``POST /encode``: one part of a multimodal request."""

    _ROUTE: ClassVar[str] = "/encode"

    req_id: ReqId
    #: Each a data URL, base64 or URL, or an object with ``url``.
    mm_items: Annotated[
        tuple[Annotated[str, msgspec.Meta(min_length=1)] | dict[str, Any], ...],
        msgspec.Meta(min_length=1),
    ]
    modality: ModalityName = "image"
    num_parts: Positive = 1
    part_idx: Count = 0
    hashes: tuple[Text, ...] | None = None

    def __post_init__(self) -> None:
        # A ValueError here is refused by the decoder like any invalid field.
        _check_modality(self.modality)
        if self.part_idx >= self.num_parts:
            raise ValueError(f"part_idx must be in [0, {self.num_parts}); got {self.part_idx}")
        if self.hashes is not None and len(self.hashes) != len(self.mm_items):
            raise ValueError(
                f"hashes has {len(self.hashes)} entries but mm_items has {len(self.mm_items)}"
            )

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


# --- /send -----------------------------------------------------------------------------------

_MOONCAKE_FIELDS = ("session_id", "buffer_address", "prefill_host", "embedding_port")


class _SendWire(Message, frozen=True):
    req_id: ReqId
    receive_url: Text | None = None
    session_id: Identifier | None = None
    buffer_address: Positive | None = None
    prefill_host: Identifier | None = None
    embedding_port: Port | None = None
    receive_count: Positive | None = None
    # SGLang's receivers echo the metadata answer back: checked for type, not used.
    part_idx: Count | None = None
    embedding_size: Count | None = None
    embedding_len: Count | None = None
    embedding_dim: Count | None = None


class _InternalSendWire(_SendWire, frozen=True):
    """What the data-parallel front sends a worker: ``/send``'s fields, and the header frame
    of a ZMQ push in SGLang's format, which ``POST /send`` refuses as an unknown field."""

    # Any, checked by hand: msgspec would take a string for bytes, as base64.
    sglang_header: Any = None


class SendBody(Message, frozen=True):
    """``POST /send``: deliver a staged embedding to one destination.

    Either ``receive_url`` (ZMQ) or all of ``session_id``, ``buffer_address``,
    ``prefill_host`` and ``embedding_port`` (Mooncake). The metadata SGLang's receivers echo
    back (``part_idx``, ``embedding_size``, ``embedding_len``, ``embedding_dim``) is accepted
    and checked for type, but not used.
    """

    req_id: str
    destination: Destination
    receive_count: int | None = None

    @classmethod
    def from_json(cls, body: object, *, internal: bool = False) -> Self:
        """Decode ``body`` (decoded JSON or msgpack). Not async.

        :param internal: the data-parallel front's map, which may also carry
            ``sglang_header`` (see :class:`_InternalSendWire`).
        :raises BadRequestError: naming the first invalid field.
        """
        wire = decode_fields(body, _InternalSendWire if internal else _SendWire, "/send")
        destination = _destination(wire)
        header = getattr(wire, "sglang_header", None)
        if header is not None and not isinstance(header, bytes):
            raise BadRequestError(
                f"sglang_header must be bytes, got {type(header).__name__}", req_id=wire.req_id
            )
        if header is not None and isinstance(destination, ZmqDestination):
            destination = SglangZmqDestination(destination.url, header)
        return cls(wire.req_id, destination, wire.receive_count)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly map that :meth:`from_json` reads back."""
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


def _destination(wire: _SendWire) -> Destination:
    given = [name for name in _MOONCAKE_FIELDS if getattr(wire, name) is not None]
    if wire.receive_url is not None and not given:
        return _zmq("receive_url", wire.receive_url, wire.req_id)
    if wire.receive_url is not None:
        message = (
            f"give either receive_url (ZMQ) or the Mooncake fields, not both "
            f"(got receive_url and {given[0]})"
        )
    elif not given:
        message = (
            "missing field 'receive_url' (ZMQ), or 'session_id', 'buffer_address', "
            "'prefill_host' and 'embedding_port' (Mooncake)"
        )
    elif len(given) < len(_MOONCAKE_FIELDS):
        message = f"missing field {next(n for n in _MOONCAKE_FIELDS if n not in given)!r}"
    # A registered address is a 64-bit pointer; anything larger no engine can take.
    elif wire.buffer_address is not None and wire.buffer_address > INT_MAX:
        message = f"buffer_address must be at most {INT_MAX}"
    else:
        assert wire.session_id is not None
        assert wire.buffer_address is not None
        endpoint = f"{wire.prefill_host}:{wire.embedding_port}"
        return MooncakeDestination(wire.session_id, wire.buffer_address, endpoint)
    raise BadRequestError(message, req_id=wire.req_id)


def _zmq(name: str, url: str, req_id: str) -> ZmqDestination:
    try:
        return ZmqDestination(zmq_url(name, url))
    except BadRequestError as exc:
        raise BadRequestError(exc.message, req_id=req_id) from None


# --- /scheduler_receive_url ------------------------------------------------------------------


class _ReceiveUrlWire(Message, frozen=True):
    req_id: ReqId
    receive_count: Positive
    receive_url: Text | Annotated[list[Text], msgspec.Meta(min_length=1, max_length=MAX_PUSH_URLS)]
    modality: ModalityName | None = None

    def __post_init__(self) -> None:
        if self.modality is not None:
            _check_modality(self.modality)


class ReceiveUrlBody(Message, frozen=True):
    """``POST /scheduler_receive_url``: push mode; the encoder pushes to each URL once staged.

    ``receive_url`` is one URL or a list; ``"host:port"`` means ``"tcp://host:port"``.
    ``modality`` (sent by SGLang's receivers) is accepted and checked, but not used.
    """

    req_id: str
    receive_count: int
    receive_urls: tuple[str, ...]

    @classmethod
    def from_json(cls, body: object) -> Self:
        """Decode ``body`` (decoded JSON or msgpack). Not async.

        :raises BadRequestError: naming the first invalid field.
        """
        wire = decode_fields(body, _ReceiveUrlWire, "/scheduler_receive_url")
        raw = [wire.receive_url] if isinstance(wire.receive_url, str) else wire.receive_url
        urls = (_zmq(f"receive_url[{i}]", url, wire.req_id).url for i, url in enumerate(raw))
        return cls(wire.req_id, wire.receive_count, tuple(dict.fromkeys(urls)))

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly map that :meth:`from_json` reads back."""
        return {
            "req_id": self.req_id,
            "receive_count": self.receive_count,
            "receive_url": list(self.receive_urls),
        }


# --- /scheduler_receive_meta_data and /release -------------------------------------------------


class MetadataBody(_Body, frozen=True):
    """``POST /scheduler_receive_meta_data``: wait for a part's embedding metadata."""

    _ROUTE: ClassVar[str] = "/scheduler_receive_meta_data"

    req_id: ReqId
    part_idx: Count


class ReleaseBody(_Body, frozen=True):
    """``POST /release``: release a request's staged embedding."""

    _ROUTE: ClassVar[str] = "/release"

    req_id: ReqId


# --- results ---------------------------------------------------------------------------------


def result_json(result: EncodeResult, part_idx: int) -> dict[str, Any]:
    """The answer of ``/encode`` and ``/scheduler_receive_meta_data`` (SGLang's names)."""
    answer = {
        **metadata_json(result.req_id, part_idx, result),
        "token_counts": list(result.token_counts),
        "grid": [list(row) for row in result.grid],
    }
    # Only video answers carry timing: image and audio answers stay as they were.
    if result.video_timing is not None:
        answer["video_timing"] = timing_to_wire(result.video_timing)
    return answer


def metadata_json(req_id: str, part_idx: int, result: EncodeResult) -> dict[str, Any]:
    """The part's sizes under SGLang's names alone: the ``--wire sglang`` answer of
    ``/scheduler_receive_meta_data``, which SGLang's receiver posts back as ``/send``."""
    return {
        "req_id": req_id,
        "part_idx": part_idx,
        "embedding_size": result.nbytes,
        "embedding_len": result.num_tokens,
        "embedding_dim": result.hidden_size,
    }


def result_to_wire(result: EncodeResult) -> dict[str, Any]:
    """An :class:`~encdisagg.EncodeResult` as a msgpack-friendly map."""
    wire: dict[str, Any] = msgspec.to_builtins(result)
    return wire


class _ResultWire(Message, frozen=True):
    req_id: ReqId
    num_tokens: Count
    hidden_size: Count
    dtype: Text
    nbytes: Count
    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]
    video_timing: Any = None


def result_from_wire(value: object) -> EncodeResult:
    """Decode :func:`result_to_wire`'s map strictly. Not async.

    :raises BadRequestError: naming the invalid field.
    """
    fields = msgspec.structs.asdict(decode_fields(value, _ResultWire, "encode result"))
    if fields["video_timing"] is not None:
        fields["video_timing"] = timing_from_wire(fields["video_timing"])
    return EncodeResult(**fields)
