"""Strict JSON bodies: the limits at their edges, and the large-body path (decoded in a
worker thread) refusing the same things as the small one."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from quart import Quart

from encdisagg import BadRequestError
from encdisagg.server._json import INT_MAX, INT_MIN, MAX_DEPTH, decode_body

from ._helpers import fast_config, running


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_nesting_up_to_the_limit_is_accepted() -> None:
    assert decode_body(nested(MAX_DEPTH)) is not None
    body = {"req_id": "a", "mm_items": [{"url": "x"}]}
    assert decode_body(json.dumps(body).encode()) == body


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 100_000])
def test_deeper_nesting_is_refused(depth: int) -> None:
    with pytest.raises(BadRequestError, match="nested more than 16 levels"):
        decode_body(nested(depth))


@pytest.mark.parametrize("value", [INT_MIN, -1, 0, INT_MAX])
def test_64_bit_integers_pass(value: int) -> None:
    assert decode_body(b'{"n": %d}' % value) == {"n": value}


@pytest.mark.parametrize("value", [INT_MIN - 1, INT_MAX + 1, 10**4000])
def test_integers_outside_64_bits_are_refused(value: int) -> None:
    with pytest.raises(BadRequestError, match=r"^a\[1\]\.n is outside the 64-bit"):
        decode_body(b'{"a": [0, {"n": %d}]}' % value)


def test_integers_too_long_to_parse_are_not_json() -> None:
    with pytest.raises(BadRequestError, match="not valid JSON"):
        decode_body(b'{"n": 1%s}' % (b"0" * 5000))


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"req_id": "\\ud800"}', "req_id is not valid Unicode"),
        (b'{"x": ["ok", "\\udfff"]}', "x[1] is not valid Unicode"),
        (b'{"\\ud800": 1}', "field name that is not valid Unicode"),
        (b'{"a": 1, "a": 2}', "duplicate field 'a'"),
        (b'{"a": {"b": 1, "b": 1}}', "duplicate field 'b'"),
        (b'{"n": 1e999}', "n is not a finite number"),
        (b'{"n": -Infinity}', "not valid JSON"),
        (b'{"n": NaN}', "not valid JSON"),
    ],
)
def test_values_no_later_stage_can_carry_are_refused(body: bytes, needle: str) -> None:
    with pytest.raises(BadRequestError, match=re.escape(needle)) as caught:
        decode_body(body)
    # The message itself is valid Unicode: it can be answered and logged.
    caught.value.message.encode("utf-8")


def test_a_valid_surrogate_pair_is_fine() -> None:
    assert decode_body(b'{"s": "\\ud83d\\ude00"}') == {"s": "\U0001f600"}


def test_a_long_key_is_shortened_in_messages() -> None:
    key = "k" * 10_000
    with pytest.raises(BadRequestError) as caught:
        decode_body(b'{"%s": 1, "%s": 2}' % (key.encode(), key.encode()))
    assert len(caught.value.message) < 200


LARGE = 300 * 1024  # over the size decoded in a worker thread


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"req_id": "a", "mm_items": ["' + b"A" * LARGE + b'"], "num_parts": %d}' % 2**64,
         "num_parts is outside the 64-bit"),
        (b" " * LARGE + nested(100_000), "nested more than"),
        (b'{"req_id": "a", "req_id": "b", "mm_items": ["' + b"A" * LARGE + b'"]}',
         "duplicate field 'req_id'"),
    ],
)  # fmt: skip
async def test_large_bodies_are_as_strict(
    make_app: Callable[..., Quart], body: bytes, needle: str
) -> None:
    app = make_app(fast_config(model="null"))
    async with running(app) as client:
        response = await client.post(
            "/encode", data=body, headers={"Content-Type": "application/json"}
        )
        answer = await response.get_json()
    assert response.status_code == 400, answer
    assert needle in answer["message"]
