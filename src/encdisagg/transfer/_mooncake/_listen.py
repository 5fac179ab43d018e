"""Keeping the Mooncake engine's listening ports to the host it was configured with.

Mooncake's transfer engine (0.3.x) binds its handshake (RPC) port and its TCP data port to
the wildcard address whatever host it is given, and no setting changes that:
``MC_TCP_BIND_ADDRESS`` only picks the address it *advertises*, and the listeners are
created with ``INADDR_ANY`` / ``in6addr_any`` in its C++ code. Both ports answer whoever
connects, and the TCP data port reads or writes any process memory a request names.

So once the engine started, :func:`keep_listeners_to_host` attaches a classic BPF socket
filter to the listening sockets it opened: the kernel then drops every packet to them that
is not addressed to the configured host, before a connection exists (a connection attempt
through another interface is never answered, as with a firewall rule). Accepted
connections inherit the filter. ``ss -ltn`` still lists the wildcard address: the bind
itself cannot be changed from outside the engine.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Collection
from typing import Final

from ..._errors import TransferError

__all__ = ["keep_listeners_to_host", "socket_inodes"]

logger = logging.getLogger(__name__)

_WILDCARDS: Final = frozenset({"", "*", "0.0.0.0", "::"})
# Mooncake picks both ports in [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT], 15000-17000 by default.
_DEFAULT_PORTS: Final = (15000, 17000)

# Classic BPF (linux/filter.h). On a TCP socket the filter sees the packet from its TCP
# header on; SKF_NET_OFF-relative loads reach the IP header.
_SO_ATTACH_FILTER: Final = 26
_SKF_NET_OFF: Final = -0x100000
_LD_B_ABS: Final = 0x30
_LD_W_ABS: Final = 0x20
_RSH_K: Final = 0x74
_JEQ_K: Final = 0x15
_RET_K: Final = 0x06
_ACCEPT: Final = 0xFFFFFFFF  # keep the whole packet
_DROP: Final = 0


def socket_inodes() -> dict[str, int]:
    """The sockets this process has open now, by inode: their descriptors (``/proc/self/fd``)."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:"):
            found[target] = int(fd)
    return found


def _instruction(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _only_to(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[bytes]:
    """A program passing only IP packets whose destination is ``address``."""
    words = [
        int.from_bytes(address.packed[i : i + 4], "big") for i in range(0, len(address.packed), 4)
    ]
    # IPv4: destination at byte 16 of the header; IPv6: bytes 24-39.
    first = _SKF_NET_OFF + (16 if address.version == 4 else 24)
    compare: list[bytes] = []
    for index, word in enumerate(words):
        remaining = len(words) - index - 1
        compare.append(_instruction(_LD_W_ABS, 0, 0, first + 4 * index))
        # Equal: on to the next word (or to ACCEPT); else jump to DROP.
        compare.append(_instruction(_JEQ_K, 0, 2 * remaining + 1, word))
    return [
        _instruction(_LD_B_ABS, 0, 0, _SKF_NET_OFF),
        _instruction(_RSH_K, 0, 0, 4),
        _instruction(_JEQ_K, 0, len(compare) + 1, address.version),
        *compare,
        _instruction(_RET_K, 0, 0, _ACCEPT),
        _instruction(_RET_K, 0, 0, _DROP),
    ]


def _resolve(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise TransferError(f"mooncake host {host!r} does not resolve: {exc}") from None
    return ipaddress.ip_address(infos[0][4][0])


def _port_range() -> tuple[int, int]:
    try:
        low = int(os.environ.get("MC_MIN_RPC_PORT", _DEFAULT_PORTS[0]))
        high = int(os.environ.get("MC_MAX_RPC_PORT", _DEFAULT_PORTS[1]))
    except ValueError:
        return (1, 65535)
    return (low, high)


def keep_listeners_to_host(host: str, before: Collection[str], rpc_port: int) -> list[int]:
    """Restrict the wildcard TCP listeners opened since ``before`` to ``host``.

    Only listeners on the wildcard address whose port is ``rpc_port`` or in Mooncake's port
    range are touched, so that another listener bound meanwhile stays as it is. Returns
    the ports restricted; nothing is done for a wildcard ``host``. Blocks briefly (name
    resolution); call it where the engine was started.

    :raises TransferError: ``host`` does not resolve, or the kernel refused the filter.
    """
    if host in _WILDCARDS:
        return []
    address = _resolve(host)
    program = _only_to(address)
    code = ctypes.create_string_buffer(b"".join(program))
    fprog = struct.pack("HL", len(program), ctypes.addressof(code))
    low, high = _port_range()
    restricted: list[int] = []
    for inode, fd in socket_inodes().items():
        if inode in before:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.type != socket.SOCK_STREAM:
                continue
            try:
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                bound, port = sock.getsockname()[:2]
            except OSError:  # not a TCP/IP socket
                continue
            if not listening or bound not in _WILDCARDS:
                continue
            if port != rpc_port and not low <= port <= high:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
            except OSError as exc:
                raise TransferError(
                    f"cannot keep Mooncake's port {port} to {host}: {exc}"
                ) from None
            restricted.append(port)
    if restricted:
        logger.info("Mooncake ports %s answer only connections to %s", restricted, address)
    else:
        logger.warning(
            "found no Mooncake listener to keep to %s: its ports may answer on every interface",
            address,
        )
    return sorted(restricted)
