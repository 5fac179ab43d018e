"""The body vLLM's disaggregated-encoder proxy posts to an encoder, decoded strictly.

``POST /v1/chat/completions`` carries one user message whose content is only media items
(``image_url``, ``video_url``, ``audio_url``, ``input_audio``), each with the ``uuid`` the
PD's identifier will equal, plus ``model``, ``stream: false`` and, for a Mooncake consumer,
``ec_transfer_params`` naming the consumer's control address and one ``transfer_id`` per item.

What would make the PD's identifier differ from the uuid is refused: an item without one, and
non-empty ``mm_processor_kwargs`` / ``media_io_kwargs`` (vLLM then hashes them with the PD's
model id). So is anything this encoder cannot answer: text items, ``stream: true``, unknown
fields. Every refusal is a :class:`~encdisagg.BadRequestError` naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Self

from ..._errors import BadRequestError
from ..._modality import Modality
from .._fields import MAX_TEXT_CHARS, split_host_port, type_name
from .._json import shown

__all__ = ["ChatBody", "MediaItem"]

_TOP_FIELDS: Final = frozenset(
    {
        "model",
        "stream",
        "messages",
        "mm_processor_kwargs",
        "media_io_kwargs",
        "priority",
        "session_id",
        "max_tokens",
        "ec_transfer_params",
    }
)
#: Items in one request: vLLM's proxy sends at most its batch size (images) or one.
MAX_ITEMS: Final = 256
#: The media item types, their modality, and the field holding their source.
_MEDIA: Final[Mapping[str, Modality]] = {
    "image_url": Modality.IMAGE,
    "video_url": Modality.VIDEO,
    "audio_url": Modality.AUDIO,
    "input_audio": Modality.AUDIO,
}
#: ``input_audio`` formats, as OpenAI's API names them.
_AUDIO_FORMATS: Final = frozenset({"wav", "mp3", "flac", "ogg", "m4a", "webm"})
#: A uuid names a folder beneath the shared storage: no separators, no dot-only names.
_UUID: Final = re.compile(r"[A-Za-z0-9_:.+=-]{1,256}")


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item of the request.

    :ivar uuid: the item's identifier (the PD's ``mm_hash``).
    :ivar source: what our Encoder takes (a URL or ``data:`` URL).
    :ivar index: its position among the request's media items (``item_indices``).
    """

    uuid: str
    modality: Modality
    source: str
    index: int


@dataclass(frozen=True, slots=True)
class ChatBody:
    """``POST /v1/chat/completions`` as vLLM's proxy sends it to an encoder.

    :ivar consumer_zmq: the Mooncake consumer's control address (``tcp://host:port``), or
        ``None`` when the body has no ``ec_transfer_params`` (shared storage).
    :ivar transfer_ids: one per item, by position (with ``consumer_zmq``).
    """

    model: str
    items: tuple[MediaItem, ...]
    consumer_zmq: str | None
    transfer_ids: tuple[str, ...] | None

    @classmethod
    def from_json(cls, body: object) -> Self:
        """:raises BadRequestError: naming the first invalid field."""
        top = _object(body, "the body")
        _known(top, _TOP_FIELDS, "")
        model = _text(top.get("model"), "model")
        stream = top.get("stream", False)
        if stream is not False:
            raise BadRequestError(
                f"stream must be false: an encoder answers once; got {shown(repr(stream))}"
            )
        for name in ("mm_processor_kwargs", "media_io_kwargs"):
            value = top.get(name)
            if value is None:
                continue
            if _object(value, name):
                raise BadRequestError(
                    f"{name} must be empty: vLLM then derives the item's identifier from them "
                    "and the PD's model id, which this encoder cannot reproduce"
                )
        _optional_int(top, "priority")
        _optional_int(top, "max_tokens", minimum=0)
        if top.get("session_id") is not None:
            _text(top["session_id"], "session_id")
        items = _items(top.get("messages"))
        consumer, transfer_ids = _transfer(top.get("ec_transfer_params"), len(items))
        return cls(model, items, consumer, transfer_ids)


def _object(value: object, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise BadRequestError(f"{name} must be a JSON object, got {type_name(value)}")
    return value


def _known(value: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(str(key) for key in value if key not in allowed)
    if unknown:
        place = f" in {where}" if where else ""
        raise BadRequestError(f"unknown field {shown(unknown[0])}{place}")


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"{name} must be a non-empty string, got {type_name(value)}")
    return value


def _optional_int(top: Mapping[str, Any], name: str, *, minimum: int | None = None) -> None:
    value = top.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"{name} must be an integer, got {type_name(value)}")
    if minimum is not None and value < minimum:
        raise BadRequestError(f"{name} must be at least {minimum}; got {value}")


def _items(messages: object) -> tuple[MediaItem, ...]:
    if not isinstance(messages, list) or not messages:
        shown_type = "an empty list" if messages == [] else type_name(messages)
        raise BadRequestError(f"messages must be a non-empty list, got {shown_type}")
    items: list[MediaItem] = []
    for m, message in enumerate(messages):
        where = f"messages[{m}]"
        fields = _object(message, where)
        _known(fields, frozenset({"role", "content"}), where)
        _text(fields.get("role"), f"{where}.role")
        content = fields.get("content")
        if not isinstance(content, list):
            raise BadRequestError(
                f"{where}.content must be a list of media items, got {type_name(content)} "
                "(text is not encoded here)"
            )
        for c, part in enumerate(content):
            if len(items) == MAX_ITEMS:
                raise BadRequestError(f"messages: more than {MAX_ITEMS} media items")
            items.append(_item(part, f"{where}.content[{c}]", len(items)))
    if not items:
        raise BadRequestError("messages hold no media item to encode")
    return tuple(items)


def _item(part: object, where: str, index: int) -> MediaItem:
    fields = _object(part, where)
    kind = fields.get("type")
    if not isinstance(kind, str):
        raise BadRequestError(f"{where}.type must be a string, got {type_name(kind)}")
    modality = _MEDIA.get(kind)
    if modality is None:
        raise BadRequestError(
            f"{where}.type {shown(kind)} is not encoded here: an encoder takes only "
            f"{', '.join(_MEDIA)} items"
        )
    _known(fields, frozenset({"type", kind, "uuid"}), where)
    uuid = fields.get("uuid")
    if uuid is None:
        raise BadRequestError(
            f"{where}.uuid is missing: the PD identifies the item by its uuid; without one "
            "it hashes the media bytes itself, which this encoder does not reproduce"
        )
    if not isinstance(uuid, str) or _UUID.fullmatch(uuid) is None or set(uuid) == {"."}:
        raise BadRequestError(
            f"{where}.uuid must be 1 to 256 letters, digits or _:.+=- (a file name), "
            f"got {shown(str(uuid))}"
        )
    media = _object(fields.get(kind), f"{where}.{kind}")
    if kind == "input_audio":
        _known(media, frozenset({"data", "format"}), f"{where}.{kind}")
        data = _text(media.get("data"), f"{where}.{kind}.data")
        audio_format = _text(media.get("format"), f"{where}.{kind}.format").lower()
        if audio_format not in _AUDIO_FORMATS:
            raise BadRequestError(
                f"{where}.{kind}.format must be one of {', '.join(sorted(_AUDIO_FORMATS))}; "
                f"got {shown(audio_format)}"
            )
        source = f"data:audio/{audio_format};base64,{data}"
    else:
        _known(media, frozenset({"url"}), f"{where}.{kind}")
        source = _text(media.get("url"), f"{where}.{kind}.url")
    return MediaItem(uuid, modality, source, index)


def _transfer(params: object, count: int) -> tuple[str | None, tuple[str, ...] | None]:
    if params is None:
        return None, None
    fields = _object(params, "ec_transfer_params")
    _known(fields, frozenset({"consumer_zmq", "ec_items"}), "ec_transfer_params")
    address = _text(fields.get("consumer_zmq"), "ec_transfer_params.consumer_zmq")
    if len(address) > MAX_TEXT_CHARS or split_host_port(address.removeprefix("tcp://")) is None:
        raise BadRequestError(
            f"ec_transfer_params.consumer_zmq must be tcp://host:port; got {shown(address)}"
        )
    entries = fields.get("ec_items")
    if not isinstance(entries, list) or len(entries) != count:
        raise BadRequestError(
            f"ec_transfer_params.ec_items must list one entry per media item ({count})"
        )
    ids: list[str] = []
    for index, entry in enumerate(entries):
        where = f"ec_transfer_params.ec_items[{index}]"
        entry_fields = _object(entry, where)
        _known(entry_fields, frozenset({"transfer_id"}), where)
        transfer_id = _text(entry_fields.get("transfer_id"), f"{where}.transfer_id")
        if len(transfer_id) > MAX_TEXT_CHARS:
            raise BadRequestError(f"{where}.transfer_id is longer than {MAX_TEXT_CHARS}")
        ids.append(transfer_id)
    return "tcp://" + address.removeprefix("tcp://"), tuple(ids)
