"""Malformed bodies: each gets a 4xx whose message names the offending field; none a 5xx."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from quart import Quart

from ._helpers import fast_config, png_data_url, running

pytestmark = pytest.mark.anyio

IMAGE = png_data_url(56, 56)

# (route, body (JSON value, or raw bytes), expected status, text the message must contain)
CASES: list[tuple[str, Any, int, str]] = [
    # Not a JSON object at all.
    ("/encode", b"", 400, "empty"),
    ("/encode", b"{not json", 400, "not valid JSON"),
    ("/encode", b'{"req_id": NaN}', 400, "not valid JSON"),
    ("/encode", b"\xff\xfe", 400, "not valid JSON"),
    ("/encode", [1, 2], 400, "JSON object"),
    ("/encode", "a string", 400, "JSON object"),
    ("/send", None, 400, "JSON object"),
    # /encode fields.
    ("/encode", {"mm_items": [IMAGE]}, 400, "req_id"),
    ("/encode", {"req_id": "", "mm_items": [IMAGE]}, 400, "req_id"),
    ("/encode", {"req_id": 7, "mm_items": [IMAGE]}, 400, "req_id"),
    ("/encode", {"req_id": "a"}, 400, "mm_items"),
    ("/encode", {"req_id": "a", "mm_items": []}, 400, "mm_items"),
    ("/encode", {"req_id": "a", "mm_items": IMAGE}, 400, "mm_items"),
    ("/encode", {"req_id": "a", "mm_items": [3]}, 400, "mm_items[0]"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE, None]}, 400, "mm_items[1]"),
    ("/encode", {"req_id": "a", "mm_items": [""]}, 400, "mm_items[0]"),
    ("/encode", {"req_id": "a", "mm_items": [[IMAGE]]}, 400, "mm_items[0]"),
    ("/encode", {"req_id": "a", "mm_items": ["@@@"]}, 400, "mm_items[0]"),
    ("/encode", {"req_id": "a", "mm_items": [{"url": IMAGE, "x": 1}]}, 400, "mm_items[0]"),
    ("/encode", {"req_id": "a", "mm_items": [{"url": 5}]}, 400, "mm_items[0].url"),
    (
        "/encode",
        {"req_id": "a", "mm_items": [{"url": IMAGE, "content_hash": "ab"}]},
        400,
        "content_hash",
    ),
    ("/encode", {"req_id": "a", "mm_items": ["http://example.com/x.png"]}, 400, "mm_items[0]"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "modality": "smell"}, 400, "modality"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "modality": 1}, 400, "modality"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "num_parts": 0}, 400, "num_parts"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "num_parts": True}, 400, "num_parts"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "num_parts": 1.5}, 400, "num_parts"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "num_parts": "2"}, 400, "num_parts"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "part_idx": -1}, 400, "part_idx"),
    (
        "/encode",
        {"req_id": "a", "mm_items": [IMAGE], "num_parts": 2, "part_idx": 2},
        400,
        "part_idx",
    ),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "part_idx": False}, 400, "part_idx"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "hashes": "h"}, 400, "hashes"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "hashes": ["h", "i"]}, 400, "hashes"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "hashes": [1]}, 400, "hashes[0]"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "extra": 1}, 400, "extra"),
    ("/encode", {"req_id": "a", "mm_items": [IMAGE], "embedding_port": 5}, 400, "embedding_port"),
    # /send fields.
    ("/send", {"receive_url": "tcp://127.0.0.1:9"}, 400, "req_id"),
    ("/send", {"req_id": "a"}, 400, "receive_url"),
    ("/send", {"req_id": "a", "receive_url": 5}, 400, "receive_url"),
    ("/send", {"req_id": "a", "receive_url": ""}, 400, "receive_url"),
    ("/send", {"req_id": "a", "receive_url": "tcp://h:1", "session_id": "s"}, 400, "session_id"),
    (
        "/send",
        {"req_id": "a", "session_id": "s", "buffer_address": 1, "prefill_host": "h"},
        400,
        "embedding_port",
    ),
    (
        "/send",
        {
            "req_id": "a",
            "session_id": "s",
            "buffer_address": "1",
            "prefill_host": "h",
            "embedding_port": 1,
        },
        400,
        "buffer_address",
    ),
    (
        "/send",
        {
            "req_id": "a",
            "session_id": "s",
            "buffer_address": 0,
            "prefill_host": "h",
            "embedding_port": 1,
        },
        400,
        "buffer_address",
    ),
    (
        "/send",
        {
            "req_id": "a",
            "session_id": "s",
            "buffer_address": 1,
            "prefill_host": "h",
            "embedding_port": 70000,
        },
        400,
        "embedding_port",
    ),
    (
        "/send",
        {
            "req_id": "a",
            "session_id": 3,
            "buffer_address": 1,
            "prefill_host": "h",
            "embedding_port": 1,
        },
        400,
        "session_id",
    ),
    (
        "/send",
        {
            "req_id": "a",
            "session_id": "s",
            "buffer_address": 1,
            "prefill_host": True,
            "embedding_port": 1,
        },
        400,
        "prefill_host",
    ),
    (
        "/send",
        {"req_id": "a", "receive_url": "tcp://h:1", "receive_count": 0},
        400,
        "receive_count",
    ),
    (
        "/send",
        {"req_id": "a", "receive_url": "tcp://h:1", "receive_count": True},
        400,
        "receive_count",
    ),
    (
        "/send",
        {"req_id": "a", "receive_url": "tcp://h:1", "embedding_len": "9"},
        400,
        "embedding_len",
    ),
    ("/send", {"req_id": "a", "receive_url": "tcp://h:1", "bogus": None}, 400, "bogus"),
    # /scheduler_receive_url fields.
    ("/scheduler_receive_url", {"req_id": "a", "receive_url": "tcp://h:1"}, 400, "receive_count"),
    ("/scheduler_receive_url", {"req_id": "a", "receive_count": 1}, 400, "receive_url"),
    (
        "/scheduler_receive_url",
        {"req_id": "a", "receive_count": 1, "receive_url": []},
        400,
        "receive_url",
    ),
    (
        "/scheduler_receive_url",
        {"req_id": "a", "receive_count": 1, "receive_url": ["h:1", 2]},
        400,
        "receive_url[1]",
    ),
    (
        "/scheduler_receive_url",
        {"req_id": "a", "receive_count": "1", "receive_url": "h:1"},
        400,
        "receive_count",
    ),
    (
        "/scheduler_receive_url",
        {"req_id": "a", "receive_count": 1, "receive_url": "h:1", "modality": "smell"},
        400,
        "modality",
    ),
    (
        "/scheduler_receive_url",
        {"req_id": "a", "receive_count": 1, "receive_url": "h:1", "port": 1},
        400,
        "port",
    ),
    # /scheduler_receive_meta_data fields.
    ("/scheduler_receive_meta_data", {"req_id": "a"}, 400, "part_idx"),
    ("/scheduler_receive_meta_data", {"part_idx": 0}, 400, "req_id"),
    ("/scheduler_receive_meta_data", {"req_id": "a", "part_idx": "0"}, 400, "part_idx"),
    ("/scheduler_receive_meta_data", {"req_id": "a", "part_idx": 0, "x": 1}, 400, "x"),
    # /release fields.
    ("/release", {}, 400, "req_id"),
    ("/release", {"req_id": None}, 400, "req_id"),
    ("/release", {"req_id": ["a"]}, 400, "req_id"),
    ("/release", {"req_id": "a", "part_idx": 0}, 400, "part_idx"),
    # Oversized body.
    ("/encode", {"req_id": "a", "mm_items": ["QUFB" * 40_000]}, 413, "larger than the limit"),
]


@pytest.mark.parametrize(("route", "body", "status", "needle"), CASES)
async def test_malformed_bodies_are_4xx_naming_the_field(
    make_app: Callable[..., Quart],
    route: str,
    body: Any,
    status: int,
    needle: str,
) -> None:
    app = make_app(fast_config(request_timeout_s=1.0), max_body_bytes=64 * 1024)
    async with running(app) as client:
        if isinstance(body, bytes):
            response = await client.post(
                route, data=body, headers={"Content-Type": "application/json"}
            )
        else:
            response = await client.post(route, json=body)
        answer = await response.get_json()
    assert response.status_code == status, answer
    assert answer["status"] == "error"
    assert needle in answer["message"], answer["message"]
    assert set(answer) == {"status", "message", "req_id"}
