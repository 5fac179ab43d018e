"""CURVE (libzmq's CurveZMQ) for embedding pushes: keys, and the options that turn it on.

A receiver holds a key pair and binds as the CURVE server; an encoder holds the receiver's
public key and connects as a CURVE client with a key pair of its own (one per push pool,
made up on the spot: receivers do not check client keys). The handshake only completes for
a client that knows the server's public key, so that key is the credential: whoever holds
it may push. Treat it as a secret shared with the encoders, not as something to publish.
Every message is then encrypted and authenticated; a peer without the key never gets a
connection, so it can neither inject a part nor fail a pending request.

Keys are Z85 text (40 characters, as ``zmq.curve_keypair()`` makes them) or 32 raw bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import zmq
import zmq.utils.z85

from ..._errors import BadRequestError

__all__ = [
    "CurveClient",
    "curve_key",
    "parse_server_keys",
    "require_curve",
    "secure_server",
]

_Z85: Final = frozenset(zmq.utils.z85.Z85CHARS)
_Z85_KEY_CHARS: Final = 40
_RAW_KEY_BYTES: Final = 32


def require_curve() -> None:
    """:raises BadRequestError: this libzmq was built without CURVE."""
    if not zmq.has("curve"):
        raise BadRequestError(
            f"CURVE is configured, but libzmq {zmq.zmq_version()} was built without it"
        )


def curve_key(value: object, name: str) -> bytes:
    """``value`` as a Z85 key (40 bytes of text).

    :raises BadRequestError: naming ``name``, for anything but 40 Z85 characters or 32 raw
        bytes. The message never shows the value (it may be a secret key).
    """
    if isinstance(value, str):
        text = value.encode("utf-8", "surrogatepass")
        if len(text) == _Z85_KEY_CHARS and all(byte in _Z85 for byte in text):
            return text
    elif isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
        if len(raw) == _Z85_KEY_CHARS and all(byte in _Z85 for byte in raw):
            return raw
        if len(raw) == _RAW_KEY_BYTES:
            return zmq.utils.z85.encode(raw)
    raise BadRequestError(
        f"{name} must be a CURVE key: 40 Z85 characters (as zmq.curve_keypair() makes "
        "them) or 32 raw bytes"
    )


def parse_server_keys(entries: Iterable[str], name: str) -> dict[str, bytes]:
    """``"tcp://host:port KEY"`` entries as a mapping of endpoint to key.

    :raises BadRequestError: naming ``name`` and the entry's index for a malformed entry
        or an endpoint listed twice.
    """
    keys: dict[str, bytes] = {}
    for index, entry in enumerate(entries):
        where = f"{name}[{index}]"
        url, _, key = str(entry).strip().partition(" ")
        if not url.startswith("tcp://") or not key.strip():
            raise BadRequestError(f"{where} must be 'tcp://host:port KEY'")
        if url in keys:
            raise BadRequestError(f"{where}: {url} is listed twice")
        keys[url] = curve_key(key.strip(), where)
    return keys


@dataclass(frozen=True, eq=False)
class CurveClient:
    """What a push pool needs to connect as a CURVE client.

    :param server_key: the key of every receiver not in ``server_keys``; ``None``: each
        endpoint pushed to must be in ``server_keys``.
    :param server_keys: per-endpoint receiver keys (by the exact URL pushed to).
    """

    server_key: bytes | None = None
    server_keys: Mapping[str, bytes] = field(default_factory=dict)
    public_key: bytes = b""
    secret_key: bytes = b""

    @classmethod
    def create(
        cls, server_key: object = None, server_keys: Mapping[str, object] | None = None
    ) -> CurveClient | None:
        """A client with a fresh key pair, or ``None`` when no key is given (no CURVE).

        :raises BadRequestError: a malformed key, or CURVE missing from libzmq.
        """
        if server_key is None and not server_keys:
            return None
        require_curve()
        default = None if server_key is None else curve_key(server_key, "curve_server_key")
        per_url = {
            url: curve_key(key, f"curve_server_keys[{url!r}]")
            for url, key in (server_keys or {}).items()
        }
        public, secret = zmq.curve_keypair()
        return cls(default, per_url, public, secret)

    def server_key_for(self, url: str) -> bytes | None:
        """The receiver key for ``url``; ``None`` if there is none (then nothing is sent:
        once CURVE is configured, no push goes out in the clear)."""
        return self.server_keys.get(url, self.server_key)

    def secure(self, sock: zmq.Socket[Any], server_key: bytes) -> None:
        """Make ``sock`` (not yet connected) a CURVE client of ``server_key``."""
        sock.curve_serverkey = server_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key


def secure_server(sock: zmq.Socket[Any], secret_key: bytes) -> None:
    """Make ``sock`` (not yet bound) a CURVE server."""
    sock.curve_server = True
    sock.curve_secretkey = secret_key
