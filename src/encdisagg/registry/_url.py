"""The ``--registry`` setting: an ``etcd://HOST:PORT/PREFIX`` URL, parsed strictly."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from .._errors import BadRequestError

__all__ = ["RegistryUrl", "parse_registry_url"]

SCHEME = "etcd"
#: The prefix used when the URL names none.
DEFAULT_PREFIX = "/encdisagg/encoders/"


@dataclass(frozen=True, slots=True)
class RegistryUrl:
    """Where the encoder fleet is registered: an etcd server and a key prefix."""

    host: str
    port: int
    #: Every encoder's key starts with it; always ends with ``/``.
    prefix: str

    @property
    def gateway(self) -> str:
        """The base URL of etcd's v3 JSON gateway, ``http://host:port``."""
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}"

    def key(self, name: str) -> str:
        """The key of the encoder called ``name`` (its URL, typically)."""
        return self.prefix + name

    def __str__(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}://{shown}:{self.port}{self.prefix}"


def parse_registry_url(url: str, *, field: str = "registry") -> RegistryUrl:
    """Parse ``etcd://HOST:PORT/PREFIX``. Not async.

    The prefix is the URL's path (``/encdisagg/encoders/`` when empty) and gets a trailing
    ``/``, so one fleet's prefix is never the start of another's.

    :raises BadRequestError: naming ``field`` and the part that is wrong.
    """
    if not isinstance(url, str) or not url:
        raise BadRequestError(f"{field} must be an etcd://HOST:PORT/PREFIX URL")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != SCHEME:
        raise BadRequestError(f"{field}: the scheme must be {SCHEME}://; got {url!r}")
    if parsed.query or parsed.fragment or parsed.username or parsed.password:
        raise BadRequestError(f"{field}: no user, query or fragment is allowed; got {url!r}")
    host = parsed.hostname
    if not host:
        raise BadRequestError(f"{field}: the URL names no host; got {url!r}")
    try:
        port = parsed.port
    except ValueError:
        raise BadRequestError(f"{field}: the port is not a number in [1, 65535]") from None
    if port is None or port == 0:
        raise BadRequestError(f"{field}: the URL must name a port (etcd's client port)")
    prefix = urllib.parse.unquote(parsed.path) or DEFAULT_PREFIX
    if not prefix.endswith("/"):
        prefix += "/"
    if not prefix.isprintable():
        raise BadRequestError(f"{field}: the prefix must be printable")
    return RegistryUrl(host=host, port=port, prefix=prefix)
