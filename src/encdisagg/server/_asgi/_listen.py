"""The listening socket of a server, bound before anything heavy loads."""

from __future__ import annotations

import socket

__all__ = ["bind_socket", "host_port"]


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free port). Not async.

    ``encdisagg serve`` binds it before it imports the server and the model code, so a busy
    port is reported at once, and hands it to Hypercorn.

    :raises OSError: if the address cannot be bound.
    """
    sock = socket.create_server(
        (host, port),
        family=socket.AF_INET6 if ":" in host else socket.AF_INET,
        reuse_port=False,
        backlog=1024,
    )
    sock.setblocking(False)
    return sock


def host_port(host: str, port: object) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:8000``; a bracketed one as it
    is). Not async."""
    bracket = ":" in host and not host.startswith("[")
    return f"[{host}]:{port}" if bracket else f"{host}:{port}"
