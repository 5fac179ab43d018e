"""Strict decoding of what a peer sent, one way for every wire edge: msgspec Structs.

Each edge declares its messages as :class:`Message` subclasses (frozen, unknown fields
refused, bounds in ``Annotated[..., msgspec.Meta(...)]``) and decodes them with
:func:`convert` (an already decoded value) or :func:`decode` (bytes), in strict mode: a
boolean is never an integer, a string never a number. Each refusal is raised as the edge's
own error, with a message that names the field (``mm_items[0]``, ``grid[1][2]``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec

__all__ = ["Message", "convert", "decode", "explain", "pattern", "reject_ext", "shown"]

T = TypeVar("T")

#: Longest piece of peer text quoted back in a message.
_SHOWN_CHARS: Final = 64
#: msgspec's "- at `$.path`" (or "- at `key` in `$.path`") suffix.
_WHERE: Final = re.compile(r"^(.*?)(?: - at `(key` in `)?\$([^`]*)`)?$", re.DOTALL)
_FIELD: Final = re.compile(r"^Object (missing required|contains unknown) field `(.*)`$", re.DOTALL)
_EXPECTED: Final = re.compile(r"^Expected `([^`]*)`(.*)$", re.DOTALL)
_GOT: Final = re.compile(r", got `([^`]*)`")
_VALUE: Final = re.compile(r"^Invalid (?:enum )?value (.*)$", re.DOTALL)
_TYPES: Final = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "a boolean",
    "null": "null",
    "array": "a list",
    "object": "an object",
    "bytes": "bytes",
    "ext": "a msgpack extension type",
}
#: How msgspec words ``min_length=1``: said "a non-empty ..." instead.
_NOT_EMPTY = " of length >= 1"
#: Regular expressions of string fields -> what they mean, for messages (see :func:`pattern`).
_MEANINGS: dict[str, str] = {}


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of the decoded message types: frozen, and no field the type does not name."""


def shown(text: str) -> str:
    """``text`` quoted for an error message: shortened, and never a lone surrogate."""
    if len(text) > _SHOWN_CHARS:
        text = text[:_SHOWN_CHARS] + "..."
    return repr(text.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace"))


def pattern(regex: str, meaning: str) -> str:
    """``regex`` for a ``msgspec.Meta(pattern=...)``; a refusal says ``meaning`` instead."""
    _MEANINGS[repr(regex)] = meaning
    return regex


def _kinds(names: str) -> str:
    return " or ".join(_TYPES.get(name, name) for name in names.split(" | "))


def explain(exc: msgspec.ValidationError, what: str) -> str:
    """msgspec's refusal as a sentence naming the field; ``what`` names the whole value."""
    match = _WHERE.match(str(exc))
    assert match is not None  # the pattern matches any text
    detail, key, path = match.groups()
    field = (path or "").removeprefix(".") or what
    if key:
        field = f"a field name in {field}"
    if named := _FIELD.match(detail):
        verb = "missing" if named[1].startswith("missing") else "unknown"
        place = f" in {field}" if path else ""
        return f"{verb} field {shown(named[2])}{place}"
    if expected := _EXPECTED.match(detail):
        kinds = _kinds(expected[1])
        rest = _GOT.sub(lambda got: f", got {_kinds(got[1])}", expected[2])
        if rest.startswith(_NOT_EMPTY) and kinds.startswith("a "):
            kinds, rest = f"a non-empty {kinds[2:]}", rest.removeprefix(_NOT_EMPTY)
        for regex, meaning in _MEANINGS.items():
            rest = rest.replace(f" matching regex {regex}", f" of {meaning}")
        return f"{field} must be {kinds}{rest}"
    if value := _VALUE.match(detail):
        return f"{field} {value[1][:_SHOWN_CHARS]} is not one of the values taken here"
    if path is None:  # a __post_init__ check: its message names its field itself
        return detail
    return f"{field}: {detail}"


def convert(
    value: object,
    schema: type[T],
    what: str,
    error: Callable[[str], Exception],
    *,
    from_attributes: bool = False,
) -> T:
    """``value`` (plain decoded data, or with ``from_attributes`` an object whose attributes
    are the fields) as ``schema``. Not async.

    :raises Exception: ``error(message)``, the message naming the first invalid field.
    """
    try:
        return msgspec.convert(value, schema, strict=True, from_attributes=from_attributes)
    except msgspec.ValidationError as exc:
        raise error(explain(exc, what)) from None


def decode(
    decoder: msgspec.json.Decoder[T] | msgspec.msgpack.Decoder[T],
    data: bytes | bytearray | memoryview,
    what: str,
    error: Callable[[str], Exception],
) -> T:
    """``data`` decoded by ``decoder`` (built with its schema). Not async.

    :raises Exception: ``error(message)``: not JSON / msgpack, or naming the invalid field.
    """
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise error(explain(exc, what)) from None
    # ValueError: an ext_hook refusing; RecursionError: nesting too deep for an ``Any`` field.
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        kind = "JSON" if isinstance(decoder, msgspec.json.Decoder) else "msgpack"
        raise error(f"{what} is not valid {kind}: {exc}") from None


def reject_ext(code: int, data: memoryview) -> Any:
    """An ``ext_hook`` for msgpack decoders: extension types are never accepted."""
    raise ValueError(f"msgpack extension type {code} is not allowed")
