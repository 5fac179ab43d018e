"""The ``global_cache`` setting: a ``mooncake://`` URL, parsed strictly."""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass
from typing import Any

from .._errors import BadRequestError

__all__ = ["GlobalCacheSettings", "parse_global_cache_url"]

SCHEME = "mooncake"
PROTOCOLS = ("tcp", "rdma")
_METADATA_SCHEMES = ("http", "https", "etcd")

_FIELD = "global_cache"


def _fail(part: str, problem: str) -> BadRequestError:
    return BadRequestError(f"{_FIELD}: {part} {problem}")


def _param(name: str, problem: str) -> BadRequestError:
    return _fail(f"query parameter {name!r}", problem)


@dataclass(frozen=True, slots=True, kw_only=True)
class GlobalCacheSettings:
    """Where the global embedding cache lives and how the encoder treats it.

    Build it with :func:`parse_global_cache_url`; every field maps to one part of the URL.
    """

    #: The Mooncake master's RPC address, ``"host:port"`` (the URL's authority).
    master: str
    #: The metadata server Mooncake clients meet through, e.g. ``"http://host:port/metadata"``.
    metadata: str
    #: Mooncake transport: ``"tcp"`` or ``"rdma"``.
    protocol: str = "tcp"
    #: Memory (MiB) this encoder lends to the store; 0 makes it a pure client that keeps
    #: entries only in memory other processes (``mooncake_client``, other encoders) lend.
    segment_mb: int = 64
    #: The client's local transfer buffer (MiB). Every put and get passes through it, so it
    #: bounds the largest entry and the bytes one lookup fetches at once.
    buffer_mb: int = 64
    #: The host name this client advertises to its peers.
    host: str = "127.0.0.1"
    #: RDMA device names (empty: Mooncake picks).
    device: str = ""
    #: How long a request waits for a lookup before it computes its items itself.
    timeout_ms: int = 1000
    #: Consecutive store failures that open the circuit breaker.
    failures: int = 3
    #: How long the open breaker keeps the global tier skipped before it probes again.
    cooldown_s: float = 30.0
    #: Inserts waiting or running at once; an insert past this bound is dropped.
    max_pending_inserts: int = 64

    @property
    def master_host(self) -> str:
        return self.master.rpartition(":")[0].strip("[]")

    @property
    def master_port(self) -> int:
        return int(self.master.rpartition(":")[2])

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000


def _int_param(name: str, text: str, *, minimum: int) -> int:
    if not text.isdigit():
        raise _param(name, f"must be an integer >= {minimum}; got {text!r}")
    value = int(text)
    if value < minimum:
        raise _param(name, f"must be at least {minimum}; got {value}")
    return value


def _float_param(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise _param(name, f"must be a positive number; got {text!r}")
    return value


def _metadata_param(text: str) -> str:
    if text == "P2PHANDSHAKE":
        raise _param("metadata", "must name a metadata server; the store cannot use P2PHANDSHAKE")
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in _METADATA_SCHEMES or not parts.hostname:
        raise _param("metadata", f"must be an http(s):// or etcd:// URL with a host; got {text!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise _param("metadata", f"has an invalid port: {text!r}") from None
    return text


def parse_global_cache_url(url: str, *, default_host: str = "127.0.0.1") -> GlobalCacheSettings:
    """Parse ``mooncake://MASTER_HOST:PORT?metadata=URL[&name=value...]``.

    Query parameters: ``metadata`` (required), ``protocol`` (``tcp``/``rdma``), ``segment_mb``,
    ``buffer_mb``, ``host`` (default ``default_host``), ``device``, ``timeout_ms``,
    ``failures``, ``cooldown_s``, ``max_pending_inserts``; see :class:`GlobalCacheSettings`.
    Does not block.

    :raises BadRequestError: naming the part of the URL that is wrong: the scheme, the
        master address, a missing, repeated, unknown or invalid query parameter.
    """
    if not isinstance(url, str) or not url:
        raise BadRequestError(f"{_FIELD} must be a non-empty mooncake:// URL")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise _fail("URL", f"cannot be parsed: {exc}") from None
    if parts.scheme != SCHEME:
        raise _fail("scheme", f"must be {SCHEME}://; got {parts.scheme or url!r}")
    if parts.username is not None or parts.password is not None:
        raise _fail("master address", "must not carry user information")
    try:
        port = parts.port
    except ValueError:
        raise _fail("master address", f"has an invalid port: {parts.netloc!r}") from None
    if not parts.hostname or port is None or port == 0:
        raise _fail("master address", f"must be host:port; got {parts.netloc!r}")
    if parts.path not in ("", "/"):
        raise _fail("path", f"must be empty; got {parts.path!r}")
    if parts.fragment:
        raise _fail("fragment", f"must be empty; got {parts.fragment!r}")
    try:
        pairs = urllib.parse.parse_qsl(
            parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)
        )
    except ValueError as exc:
        raise _fail("query", f"cannot be parsed: {exc}") from None
    seen: dict[str, str] = {}
    for name, value in pairs:
        if name in seen:
            raise _param(name, "is given more than once")
        seen[name] = value
    host = parts.hostname
    master = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    values: dict[str, Any] = {"master": master, "host": default_host}
    for name, text in seen.items():
        if name == "metadata":
            values[name] = _metadata_param(text)
        elif name == "protocol":
            if text not in PROTOCOLS:
                raise _param(name, f"must be one of {', '.join(PROTOCOLS)}; got {text!r}")
            values[name] = text
        elif name == "segment_mb":
            values[name] = _int_param(name, text, minimum=0)
        elif name in ("buffer_mb", "timeout_ms", "failures", "max_pending_inserts"):
            values[name] = _int_param(name, text, minimum=1)
        elif name == "cooldown_s":
            values[name] = _float_param(name, text)
        elif name == "host":
            if not text or any(ch.isspace() for ch in text) or "/" in text:
                raise _param(name, f"must be a host name; got {text!r}")
            values[name] = text
        elif name == "device":
            values[name] = text
        else:
            raise _param(name, "is unknown")
    if "metadata" not in values:
        raise _param(
            "metadata", "is required (the metadata server URL, e.g. http://host:port/metadata)"
        )
    return GlobalCacheSettings(**values)
