"""The bodies SGLang 0.5.20's language side sends an encoder, decoded strictly.

They differ from our own routes' bodies (``_messages``) in the fields SGLang adds:
``/encode`` carries ``prefill_host``, ``embedding_port`` (an int for ``zmq_to_tokenizer``, a
list of ports for the legacy scheduler mode, ``null`` otherwise), ``encoder_idx``,
``encoder_url`` and ``time_stats_json``; ``/send`` (Mooncake) echoes the metadata answer
back with the receiver's buffer. Unknown fields and wrong types are still refused with a
:class:`~encdisagg.BadRequestError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Self

from ..._errors import BadRequestError
from ..._modality import Modality
from ...encoder import MooncakeDestination
from .._fields import Fields, type_name
from .._json import INT_MAX
from .._messages import MAX_PUSH_URLS, EncodeBody, SendBody

__all__ = ["SglangEncodeBody", "SglangSendBody", "metadata_answer"]

_ENCODE_FIELDS: Final = frozenset(
    {
        "req_id",
        "mm_items",
        "modality",
        "num_parts",
        "part_idx",
        "hashes",
        "prefill_host",
        "embedding_port",
        "encoder_idx",
        "encoder_url",
        "time_stats_json",
    }
)


@dataclass(frozen=True, slots=True)
class SglangEncodeBody:
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
        """:raises BadRequestError: naming the first invalid field."""
        fields = Fields(body, _ENCODE_FIELDS, "/encode")
        assert isinstance(body, Mapping)
        # Sent by SGLang, meaningful only to SGLang: checked for type, then left alone.
        fields.integer("encoder_idx", required=False, minimum=0)
        fields.text("encoder_url", required=False)
        stats = fields.raw("time_stats_json", required=False)
        if stats is not None and not isinstance(stats, (str, Mapping)):
            raise fields.error(
                f"time_stats_json must be a string or object, got {type_name(stats)}"
            )
        ours = {
            key: body[key]
            for key in ("req_id", "mm_items", "modality", "num_parts", "part_idx")
            if body.get(key) is not None
        }
        hashes = _hashes(fields, len(body.get("mm_items") or ()))
        if hashes is not None:
            ours["hashes"] = hashes
        encode = EncodeBody.from_json(ours)
        host = None if body.get("prefill_host") is None else fields.identifier("prefill_host")
        return cls(encode, Modality.parse(encode.modality), host, _push_urls(fields, host, body))


def _hashes(fields: Fields, items: int) -> list[str] | None:
    """SGLang's ``hashes``: a list (one per grid entry: per item for images and videos) or
    a lone scalar; integers are taken as their decimal text."""
    raw = fields.raw("hashes", required=False)
    if raw is None:
        return None
    values = raw if isinstance(raw, list) else [raw]
    out = []
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise fields.error(
                f"hashes[{index}] must be a string or integer, got {type_name(value)}"
            )
        out.append(str(value))
    if len(out) != items:
        raise fields.error(f"hashes has {len(out)} entries but mm_items has {items}")
    return out


def _push_urls(fields: Fields, host: str | None, body: Mapping[str, Any]) -> tuple[str, ...] | None:
    raw = body.get("embedding_port")
    if raw is None:
        return None
    ports = raw if isinstance(raw, list) else [raw]
    if not ports or len(ports) > MAX_PUSH_URLS:
        raise fields.error(f"embedding_port must name 1 to {MAX_PUSH_URLS} ports")
    if host is None:
        raise fields.error("missing field 'prefill_host' (needed with embedding_port)")
    urls: list[str] = []
    for index, port in enumerate(ports):
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise fields.error(
                f"embedding_port{'' if raw is port else f'[{index}]'} must be a port in "
                f"[1, 65535], got {port!r}"
            )
        url = f"tcp://{_bracketed(host)}:{port}"
        if url not in urls:
            urls.append(url)
    return tuple(urls)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


_SEND_FIELDS: Final = frozenset(
    {
        "req_id",
        "part_idx",
        "embedding_size",
        "embedding_len",
        "embedding_dim",
        "prefill_host",
        "embedding_port",
        "session_id",
        "buffer_address",
        "receive_count",
    }
)


@dataclass(frozen=True, slots=True)
class SglangSendBody:
    """``POST /send`` (Mooncake): the metadata answer, plus the receiver's buffer.

    :ivar send: our ``/send`` for the write.
    :ivar notice_url: where SGLang's receiver waits for the completion notice.
    """

    send: SendBody
    part_idx: int | None
    notice_url: str

    @classmethod
    def from_json(cls, body: object) -> Self:
        """:raises BadRequestError: naming the first invalid field."""
        fields = Fields(body, _SEND_FIELDS, "/send")
        req_id = fields.req_id_field()
        part_idx = fields.integer("part_idx", required=False, minimum=0)
        for name in ("embedding_size", "embedding_len", "embedding_dim"):
            fields.integer(name, required=False, minimum=0)
        receive_count = fields.integer("receive_count", required=False, minimum=1)
        session_id = fields.identifier("session_id")
        address = fields.integer("buffer_address", minimum=1, maximum=INT_MAX)
        host = fields.identifier("prefill_host")
        port = fields.integer("embedding_port", minimum=1, maximum=65535)
        assert address is not None
        assert port is not None
        endpoint = f"{_bracketed(host)}:{port}"
        destination = MooncakeDestination(session_id, address, endpoint)
        return cls(SendBody(req_id, destination, receive_count), part_idx, f"tcp://{endpoint}")


def metadata_answer(
    req_id: str, part_idx: int, nbytes: int, tokens: int, hidden: int
) -> dict[str, Any]:
    """``/scheduler_receive_meta_data``'s answer with SGLang's fields alone: SGLang's
    receiver posts it back as the ``/send`` body."""
    if part_idx < 0:
        raise BadRequestError("part_idx must be at least 0")
    return {
        "req_id": req_id,
        "part_idx": part_idx,
        "embedding_size": nbytes,
        "embedding_len": tokens,
        "embedding_dim": hidden,
    }
