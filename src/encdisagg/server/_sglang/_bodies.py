"""The bodies SGLang 0.5.20's language side sends an encoder, decoded strictly.

They differ from our own routes' bodies (``_messages``) in the fields SGLang adds:
``/encode`` carries ``prefill_host``, ``embedding_port`` (an int for ``zmq_to_tokenizer``, a
list of ports for the legacy scheduler mode, ``null`` otherwise), ``encoder_idx``,
``encoder_url`` and ``time_stats_json``; ``/send`` (Mooncake) echoes the metadata answer
back with the receiver's buffer. Unknown fields and wrong types are still refused with a
:class:`~encdisagg.BadRequestError` naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Self

import msgspec

from ..._errors import BadRequestError
from ..._modality import Modality
from ..._strict import Message
from ...encoder import MooncakeDestination
from .._asgi._listen import host_port
from .._fields import Count, Identifier, Port, Positive, ReqId, Text, decode_fields
from .._json import INT_MAX
from .._messages import MAX_PUSH_URLS, EncodeBody, SendBody

__all__ = ["SglangEncodeBody", "SglangSendBody"]

_Ports = Annotated[list[Port], msgspec.Meta(min_length=1, max_length=MAX_PUSH_URLS)]


class _EncodeWire(Message, frozen=True):
    # Ours: checked by EncodeBody.
    req_id: Any = None
    mm_items: Any = None
    modality: Any = None
    num_parts: Any = None
    part_idx: Any = None
    # One per grid entry (per item for images and videos), or a lone scalar; an integer is
    # taken as its decimal text.
    hashes: Text | int | list[Text | int] | None = None
    prefill_host: Identifier | None = None
    embedding_port: Port | _Ports | None = None
    # Sent by SGLang, meaningful only to SGLang: checked for type, then left alone.
    encoder_idx: Count | None = None
    encoder_url: Text | None = None
    time_stats_json: str | dict[str, Any] | None = None


class SglangEncodeBody(Message, frozen=True):
    """``POST /encode`` as SGLang's tokenizer sends it.

    :ivar encode: the part as our Encoder takes it (``hashes`` one per item).
    :ivar push_urls: where to push the embedding (``tcp://prefill_host:port`` for each
        port given), or ``None``: the scheduler ranks register their own
        (``/scheduler_receive_url``), or (Mooncake) pull it with ``/send``.
    """

    encode: EncodeBody
    modality: Modality
    prefill_host: str | None
    push_urls: tuple[str, ...] | None

    @classmethod
    def from_json(cls, body: object) -> Self:
        """Decode ``body`` (decoded JSON). Not async.

        :raises BadRequestError: naming the first invalid field.
        """
        wire = decode_fields(body, _EncodeWire, "/encode")
        ours = {name: getattr(wire, name) for name in EncodeBody.__struct_fields__}
        if wire.hashes is not None:
            hashes = wire.hashes if isinstance(wire.hashes, list) else [wire.hashes]
            ours["hashes"] = [str(value) for value in hashes]
        encode = EncodeBody.from_json(ours)
        urls = None
        if wire.embedding_port is not None:
            if wire.prefill_host is None:
                raise BadRequestError(
                    "missing field 'prefill_host' (needed with embedding_port)",
                    req_id=encode.req_id,
                )
            ports = wire.embedding_port
            urls = tuple(
                dict.fromkeys(
                    f"tcp://{host_port(wire.prefill_host, port)}"
                    for port in (ports if isinstance(ports, list) else [ports])
                )
            )
        return cls(encode, Modality.parse(encode.modality), wire.prefill_host, urls)


class _SendWire(Message, frozen=True):
    req_id: ReqId
    session_id: Identifier
    buffer_address: Positive
    prefill_host: Identifier
    embedding_port: Port
    receive_count: Positive | None = None
    # The metadata answer echoed back.
    part_idx: Count | None = None
    embedding_size: Count | None = None
    embedding_len: Count | None = None
    embedding_dim: Count | None = None


class SglangSendBody(Message, frozen=True):
    """``POST /send`` (Mooncake): the metadata answer, plus the receiver's buffer.

    :ivar send: our ``/send`` for the write.
    :ivar notice_url: where SGLang's receiver waits for the completion notice.
    """

    send: SendBody
    part_idx: int | None
    notice_url: str

    @classmethod
    def from_json(cls, body: object) -> Self:
        """Decode ``body`` (decoded JSON). Not async.

        :raises BadRequestError: naming the first invalid field.
        """
        wire = decode_fields(body, _SendWire, "/send")
        # A registered address is a 64-bit pointer; anything larger no engine can take.
        if wire.buffer_address > INT_MAX:
            raise BadRequestError(f"buffer_address must be at most {INT_MAX}", req_id=wire.req_id)
        endpoint = host_port(wire.prefill_host, wire.embedding_port)
        destination = MooncakeDestination(wire.session_id, wire.buffer_address, endpoint)
        send = SendBody(wire.req_id, destination, wire.receive_count)
        return cls(send, wire.part_idx, f"tcp://{endpoint}")
