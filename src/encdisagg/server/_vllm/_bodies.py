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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Self

import msgspec

from ..._errors import BadRequestError
from ..._modality import Modality
from ..._strict import Message, convert, pattern, shown
from .._fields import Text, split_host_port

__all__ = ["ChatBody", "MediaItem"]

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
_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
#: A uuid names a folder beneath the shared storage: no separators (and no dot-only name).
_Uuid = Annotated[
    str,
    msgspec.Meta(
        pattern=pattern(
            r"^[A-Za-z0-9_:.+=-]{1,256}\Z", "1 to 256 letters, digits or _:.+=- (a file name)"
        )
    ),
]


class _Url(Message, frozen=True):
    url: _NonEmpty


class _Audio(Message, frozen=True):
    data: _NonEmpty
    format: _NonEmpty


class _Part(Message, frozen=True, kw_only=True, tag_field="type"):
    uuid: _Uuid | None = None


class _ImageUrl(_Part, frozen=True, tag="image_url"):
    image_url: _Url


class _VideoUrl(_Part, frozen=True, tag="video_url"):
    video_url: _Url


class _AudioUrl(_Part, frozen=True, tag="audio_url"):
    audio_url: _Url


class _InputAudio(_Part, frozen=True, tag="input_audio"):
    input_audio: _Audio


class _Message(Message, frozen=True):
    role: _NonEmpty
    content: list[_ImageUrl | _VideoUrl | _AudioUrl | _InputAudio]


class _TransferItem(Message, frozen=True):
    transfer_id: Text


class _TransferParams(Message, frozen=True):
    consumer_zmq: Text
    ec_items: list[_TransferItem]


class _Chat(Message, frozen=True):
    model: _NonEmpty
    messages: Annotated[list[_Message], msgspec.Meta(min_length=1)]
    stream: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    priority: int | None = None
    session_id: _NonEmpty | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    ec_transfer_params: _TransferParams | None = None

    def __post_init__(self) -> None:
        if self.stream:
            raise ValueError("stream must be false: an encoder answers once; got True")
        for name in ("mm_processor_kwargs", "media_io_kwargs"):
            if getattr(self, name):
                raise ValueError(
                    f"{name} must be empty: vLLM then derives the item's identifier from them "
                    "and the PD's model id, which this encoder cannot reproduce"
                )


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
        """Decode ``body`` (decoded JSON). Not async.

        :raises BadRequestError: naming the first invalid field.
        """
        chat = convert(body, _Chat, "the body", BadRequestError)
        items = _items(chat.messages)
        consumer, transfer_ids = _transfer(chat.ec_transfer_params, len(items))
        return cls(chat.model, items, consumer, transfer_ids)


def _items(messages: list[_Message]) -> tuple[MediaItem, ...]:
    items: list[MediaItem] = []
    for m, message in enumerate(messages):
        for c, part in enumerate(message.content):
            if len(items) == MAX_ITEMS:
                raise BadRequestError(f"messages: more than {MAX_ITEMS} media items")
            items.append(_item(part, f"messages[{m}].content[{c}]", len(items)))
    if not items:
        raise BadRequestError("messages hold no media item to encode")
    return tuple(items)


def _item(part: _Part, where: str, index: int) -> MediaItem:
    kind = part.__struct_config__.tag
    assert isinstance(kind, str)
    if part.uuid is None:
        raise BadRequestError(
            f"{where}.uuid is missing: the PD identifies the item by its uuid; without one "
            "it hashes the media bytes itself, which this encoder does not reproduce"
        )
    if set(part.uuid) == {"."}:
        raise BadRequestError(f"{where}.uuid must be a file name, not {shown(part.uuid)}")
    if isinstance(part, _InputAudio):
        audio_format = part.input_audio.format.lower()
        if audio_format not in _AUDIO_FORMATS:
            raise BadRequestError(
                f"{where}.{kind}.format must be one of {', '.join(sorted(_AUDIO_FORMATS))}; "
                f"got {shown(audio_format)}"
            )
        source = f"data:audio/{audio_format};base64,{part.input_audio.data}"
    else:
        source = getattr(part, kind).url
    return MediaItem(part.uuid, _MEDIA[kind], source, index)


def _transfer(
    params: _TransferParams | None, count: int
) -> tuple[str | None, tuple[str, ...] | None]:
    if params is None:
        return None, None
    address = params.consumer_zmq.removeprefix("tcp://")
    if split_host_port(address) is None:
        raise BadRequestError(
            f"ec_transfer_params.consumer_zmq must be tcp://host:port; "
            f"got {shown(params.consumer_zmq)}"
        )
    if len(params.ec_items) != count:
        raise BadRequestError(
            f"ec_transfer_params.ec_items must list one entry per media item ({count})"
        )
    return "tcp://" + address, tuple(item.transfer_id for item in params.ec_items)
