"""Strict JSON for request bodies: what ``json.loads`` lets through that we must not.

``json.loads`` accepts duplicate keys (the last silently wins), nesting until the
interpreter's recursion limit (then ``RecursionError``, which is no ``ValueError``),
integers of any size, and lone UTF-16 surrogates in strings (``"\\ud800"``), which no
UTF-8 encoder (msgpack at the data-parallel front, ZMQ headers) can write later. A body
that passes :func:`decode_body` is plain JSON data that every later stage can carry:
objects with unique string keys at most :data:`MAX_DEPTH` deep, integers in the 64-bit
range, finite floats and valid Unicode. Each refusal is a
:class:`~encdisagg.BadRequestError` naming where in the body the offending value is.

:func:`public_message` bounds and scrubs an error message before any wire answers it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

from .._errors import BadRequestError
from .._strict import shown

__all__ = ["INT_MAX", "INT_MIN", "MAX_DEPTH", "decode_body", "public_message", "shown"]

#: Containers nested deeper than this are refused (our bodies need four levels).
MAX_DEPTH: Final = 16
#: The integers every later stage can carry: int64 and uint64 together.
INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**64 - 1

#: An object's default repr (``<_io.BytesIO object at 0x7f...>``): an address of this process.
_OBJECT_REPR: Final = re.compile(r"<[^<>]{0,200} at 0x[0-9A-Fa-f]+>")
#: Longest error message answered; the field it names comes first.
_MAX_MESSAGE_CHARS: Final = 1000
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
#: Longest piece of client text quoted back in a message.
_SHOWN_CHARS: Final = 64


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate field {shown(key)}")
        result[key] = value
    return result


def _has_surrogate(text: str) -> bool:
    # isascii() is O(1) for the ASCII strings (base64, ids) that make up most bodies.
    return not text.isascii() and _SURROGATE.search(text) is not None


def _path(parts: tuple[str | int, ...]) -> str:
    if not parts:
        return "the request body"
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + (part if len(part) <= _SHOWN_CHARS else shown(part))
    return out


def _check(value: object) -> None:
    """Walk ``value`` (iteratively: depth is what is being checked) and refuse the first
    value no later stage could carry."""
    stack: list[tuple[object, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, (dict, list)) and len(path) >= MAX_DEPTH:
            raise BadRequestError(f"{_path(path)} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            for key, child in item.items():
                if _has_surrogate(key):
                    raise BadRequestError(
                        f"{_path(path)} has a field name that is not valid Unicode "
                        "(a lone surrogate)"
                    )
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, (*path, index)) for index, child in enumerate(item))
        elif isinstance(item, str):
            if _has_surrogate(item):
                raise BadRequestError(f"{_path(path)} is not valid Unicode (a lone surrogate)")
        elif type(item) is int:
            if not INT_MIN <= item <= INT_MAX:
                raise BadRequestError(f"{_path(path)} is outside the 64-bit integer range")
        elif isinstance(item, float) and not math.isfinite(item):
            raise BadRequestError(f"{_path(path)} is not a finite number")


def decode_body(data: bytes) -> object:
    """Decode a request body strictly. Not async: large bodies are decoded in a thread.

    :raises BadRequestError: not JSON, a duplicate key, too deep, an integer outside the
        64-bit range, a non-finite number, or a lone surrogate; naming where.
    """
    try:
        value = json.loads(data, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except RecursionError:
        raise BadRequestError(
            f"the request body is nested more than {MAX_DEPTH} levels deep"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None
    _check(value)
    return value


def public_message(message: str) -> str:
    """``message`` as it may be answered: a library's text passed on in it may quote an
    object's repr, and so an address of this process; and it is bounded."""
    message = _OBJECT_REPR.sub("<object>", message)
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    return message
