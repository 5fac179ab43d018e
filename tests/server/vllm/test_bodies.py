"""The proxy's body, decoded strictly: what is taken, and every refusal naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from encdisagg import BadRequestError, Modality
from encdisagg.server._vllm._bodies import ChatBody

from ._bodies import chat_body, image_item, mooncake_params


def test_the_proxy_body_is_taken_with_each_uuid_and_position() -> None:
    body = chat_body(
        image_item("a" * 64),
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}, "uuid": "b"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}, "uuid": "c"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}, "uuid": "d"},
        priority=0,
        session_id="s",
        max_tokens=1,
        mm_processor_kwargs={},
        media_io_kwargs={},
    )
    parsed = ChatBody.from_json(body)
    assert [(i.uuid, i.modality, i.index) for i in parsed.items] == [
        ("a" * 64, Modality.IMAGE, 0),
        ("b", Modality.AUDIO, 1),
        ("c", Modality.AUDIO, 2),
        ("d", Modality.VIDEO, 3),
    ]
    assert parsed.items[2].source == "data:audio/wav;base64,AAAA"
    assert parsed.consumer_zmq is None
    assert parsed.transfer_ids is None


def test_mooncake_params_give_one_transfer_id_per_item() -> None:
    body = chat_body(
        image_item("a"),
        image_item("b", seed=1),
        ec_transfer_params=mooncake_params("127.0.0.1:5555", "t0", "t1"),
    )
    parsed = ChatBody.from_json(body)
    assert parsed.consumer_zmq == "tcp://127.0.0.1:5555"
    assert parsed.transfer_ids == ("t0", "t1")


def _with(body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    body.update(changes)
    return body


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (chat_body(image_item(None)), "messages[0].content[0].uuid is missing"),
        (chat_body(image_item("../x")), "messages[0].content[0].uuid must be"),
        (chat_body(image_item("..")), "messages[0].content[0].uuid must be"),
        (chat_body(image_item("a"), mm_processor_kwargs={"fps": 2}), "mm_processor_kwargs"),
        (chat_body(image_item("a"), media_io_kwargs={"video": {}}), "media_io_kwargs"),
        (chat_body({"type": "text", "text": "hi"}), "messages[0].content[0].type 'text'"),
        (chat_body(image_item("a"), stream=True), "stream must be false"),
        (chat_body(image_item("a"), temperature=0), "unknown field 'temperature'"),
        (chat_body(image_item("a", detail="x")), "unknown field 'detail' in messages[0]"),
        (_with(chat_body(), messages=[{"role": "user", "content": "hi"}]), "messages[0].content"),
        (_with(chat_body(), messages=[]), "messages must be a non-empty list"),
        (_with(chat_body(image_item("a")), model=None), "model must be"),
        (chat_body(image_item("a"), priority="high"), "priority must be an integer"),
        (
            chat_body(image_item("a"), ec_transfer_params=mooncake_params("tcp://h:1", "t", "u")),
            "ec_transfer_params.ec_items must list one entry per media item",
        ),
        (
            chat_body(image_item("a"), ec_transfer_params=mooncake_params("h", "t")),
            "ec_transfer_params.consumer_zmq must be tcp://host:port",
        ),
        (
            chat_body(
                {"type": "input_audio", "input_audio": {"data": "AA", "format": "exe"}, "uuid": "u"}
            ),
            "messages[0].content[0].input_audio.format",
        ),
        ("[]", "the body must be an object, got a string"),
    ],
)
def test_refusals_name_the_field(body: object, field: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        ChatBody.from_json(body)
    assert caught.value.status == 400
    assert field in caught.value.message
