"""Who may call the encoder routes, and whom the encoder may be told to write to.

Both checks are synchronous decisions on what the request carries; neither connects to
anything nor resolves a name:

- :class:`ApiKey`: ``Authorization: Bearer KEY``, compared in constant time. One key is one
  tenant: whoever holds it may release or send any request id.
- :class:`PeerAllowList`: the hosts and networks a ``/send`` or push destination may name.
  A Mooncake ``session_id`` (``host:port``) or a ZMQ ``receive_url`` naming anything else
  is refused (403) before the encoder opens a connection or looks a name up.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Self

from .._errors import BadRequestError, ForbiddenError
from ._fields import MAX_TEXT_CHARS, split_host_port
from ._json import shown

if TYPE_CHECKING:
    # Imported when used: the command line validates settings before torch is imported.
    from ..encoder import Destination

__all__ = ["ApiKey", "ForbiddenError", "PeerAllowList", "is_loopback_host"]

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def _address(host: str) -> _Address | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def is_loopback_host(host: str) -> bool:
    """Whether binding ``host`` serves this machine only. Resolves nothing: a hostname
    other than ``localhost`` counts as reachable from outside."""
    address = _address(host.strip("[]"))
    if address is None:
        return host.lower() in _LOOPBACK_NAMES
    return address.is_loopback


class ApiKey:
    """The one key that ``Authorization: Bearer KEY`` must carry.

    :raises BadRequestError: if ``key`` is empty or not visible ASCII (it travels in a
        header).
    """

    __slots__ = ("_expected",)

    def __init__(self, key: str) -> None:
        if not key or not key.isascii() or not key.isprintable() or " " in key:
            raise BadRequestError(
                "api_key must be non-empty visible ASCII (no spaces or control characters)"
            )
        self._expected = key.encode("ascii")

    def __repr__(self) -> str:
        return "ApiKey(<hidden>)"

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries the key. Not async."""
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        # Headers arrive decoded as latin-1; encoding back gives the bytes as sent.
        given = token.strip().encode("latin-1", "replace")
        return hmac.compare_digest(given, self._expected)


@dataclass(frozen=True, slots=True)
class PeerAllowList:
    """The hosts (matched by name, case-insensitively, never resolved) and networks (IP
    literals inside them) that destinations may name."""

    hostnames: frozenset[str]
    networks: tuple[_Network, ...]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Self:
        """From entries such as ``"10.0.0.0/8"``, ``"192.168.1.7"``, ``"::1"`` or
        ``"prefill-0.internal"``.

        :raises BadRequestError: naming the first entry that is none of these.
        """
        hostnames: set[str] = set()
        networks: list[_Network] = []
        for entry in entries:
            if not isinstance(entry, str) or not entry or len(entry) > MAX_TEXT_CHARS:
                raise BadRequestError(f"allowed_peers: {entry!r} is not a host or network")
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            name = entry.lower().rstrip(".")
            labels = name.split(".")
            if not all(label and label.replace("-", "").isalnum() for label in labels):
                raise BadRequestError(
                    f"allowed_peers: {shown(entry)} is neither an IP network nor a hostname"
                )
            hostnames.add(name)
        return cls(frozenset(hostnames), tuple(networks))

    def allows_host(self, host: str) -> bool:
        """Whether ``host`` (an IP literal or a name) is allowed. Resolves nothing."""
        address = _address(host.strip("[]"))
        if address is None:
            return host.lower().rstrip(".") in self.hostnames
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.networks)

    def check(self, field: str, endpoint: str, *, req_id: str | None = None) -> None:
        """Refuse ``endpoint`` (``host:port``, ``tcp://`` allowed before it) unless its host
        is allowed.

        :raises ForbiddenError: naming ``field``.
        """
        endpoint = endpoint.removeprefix("tcp://")
        parsed = split_host_port(endpoint)
        if parsed is None or not self.allows_host(parsed[0]):
            raise ForbiddenError(
                f"{field} {shown(endpoint)} names a peer outside the allowed peers",
                req_id=req_id,
            )

    def check_destination(self, destination: Destination, *, req_id: str | None = None) -> None:
        """Refuse a ``/send`` destination whose peer is not allowed.

        :raises ForbiddenError: naming the field (``session_id`` or ``receive_url``).
        """
        from ..encoder import ZmqDestination

        if isinstance(destination, ZmqDestination):
            self.check("receive_url", destination.url, req_id=req_id)
        else:
            self.check("session_id", destination.session_id, req_id=req_id)
