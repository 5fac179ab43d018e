"""The fields of the server's bodies: their types, and decoding one body strictly.

Shared by every body type (HTTP bodies and the data-parallel front's msgpack maps alike).
Booleans are never integers; identifiers and addresses are bounded in length and charset, so
no client text of unbounded size or odd characters is ever held, logged or quoted back.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Annotated, Final, TypeVar

import msgspec

from .._errors import BadRequestError
from .._strict import convert, pattern, shown

__all__ = [
    "MAX_REQ_ID_CHARS",
    "MAX_TEXT_CHARS",
    "Count",
    "Identifier",
    "ModalityName",
    "Port",
    "Positive",
    "ReqId",
    "Text",
    "decode_fields",
    "split_host_port",
    "type_name",
    "valid_req_id",
    "zmq_url",
]

S = TypeVar("S", bound=msgspec.Struct)

#: Longest ``req_id``: room for a UUID, a part suffix and a prefix, not for a payload.
MAX_REQ_ID_CHARS: Final = 256
#: Longest other identifier or address (session ids, hosts, URLs, hashes).
MAX_TEXT_CHARS: Final = 512
#: Visible ASCII: no spaces, control characters or non-ASCII (which logs and headers mangle).
_VISIBLE_TEXT: Final = pattern(
    r"^[\x21-\x7e]+\Z", "visible ASCII characters (no spaces or control characters)"
)
_VISIBLE: Final = re.compile(_VISIBLE_TEXT)
_HOSTNAME: Final = re.compile(r"[A-Za-z0-9_.-]+")
_IPV6: Final = re.compile(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?")


#: A request id: 1 to 256 visible ASCII characters.
ReqId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_REQ_ID_CHARS, pattern=_VISIBLE_TEXT)
]
#: Any other identifier or host: 1 to 512 visible ASCII characters.
Identifier = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_TEXT_CHARS, pattern=_VISIBLE_TEXT)
]
#: A non-empty string of at most 512 characters (URLs, hashes).
Text = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TEXT_CHARS)]
#: A modality's name, checked by :meth:`~encdisagg.Modality.parse` after decoding.
ModalityName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


def decode_fields(body: object, schema: type[S], what: str) -> S:
    """One decoded JSON body as ``schema``; a ``null`` field counts as absent. Not async.

    :raises BadRequestError: naming the first invalid field (an unknown one first), with
        the body's ``req_id`` once that is valid (only a valid id is quoted back or logged).
    """
    if not isinstance(body, dict):
        if not isinstance(body, Mapping):
            raise BadRequestError(f"the {what} body must be a JSON object, got {type_name(body)}")
        body = dict(body)
    raw_id = body.get("req_id")
    error = functools.partial(BadRequestError, req_id=raw_id if valid_req_id(raw_id) else None)
    if not body.keys() <= _field_names(schema):
        unknown = sorted(str(key) for key in body.keys() - _field_names(schema))
        raise error(f"unknown field {shown(unknown[0])} in the {what} body")
    if None in body.values():
        body = {key: value for key, value in body.items() if value is not None}
    return convert(body, schema, f"the {what} body", error)


@functools.cache
def _field_names(schema: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(schema.__struct_fields__)


def type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def valid_req_id(value: object) -> bool:
    """Whether ``value`` is an acceptable ``req_id``: 1 to 256 visible ASCII characters."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_REQ_ID_CHARS
        and _VISIBLE.match(value) is not None
    )


def split_host_port(text: str) -> tuple[str, int] | None:
    """``"host:port"`` or ``"[v6]:port"`` as (host, port), or None if it is not one.

    The host is a hostname or an IP literal (no wildcard, no user part, no path), the port
    an integer in [1, 65535]. Nothing is resolved.
    """
    if len(text) > MAX_TEXT_CHARS:
        return None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or not rest.startswith(":") or _IPV6.fullmatch(host) is None:
            return None
        port_text = rest[1:]
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon or _HOSTNAME.fullmatch(host) is None:
            return None
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
        return None
    port = int(port_text)
    return (host, port) if 1 <= port <= 65535 else None


def zmq_url(name: str, value: str) -> str:
    """A receiver's ZMQ endpoint, normalised to ``tcp://host:port``.

    SGLang's receivers register ``"host:port"``; ZMQ needs the transport prefix.

    :raises BadRequestError: naming ``name``, if it is not ``[tcp://]host:port``.
    """
    scheme, separator, rest = value.partition("://")
    if not separator:
        scheme, rest = "tcp", value
    if scheme != "tcp" or split_host_port(rest) is None:
        raise BadRequestError(
            f"{name} must be tcp://host:port (or host:port) with a port in [1, 65535]; "
            f"got {shown(value)}"
        )
    return f"tcp://{rest}"
