"""A workaround: Hypercorn keeps a keep-alive connection open after its client closed it.

In Hypercorn 0.18 (both ``hypercorn.asyncio`` and ``hypercorn.trio``), once a response is
complete the connection goes idle and a keep-alive timer task starts in the connection's
task group. When the client then closes its end, the read loop sees end-of-file and tells
the HTTP/1.1 protocol, which does nothing when no request is in flight; the connection's
task group then waits for the timer, and only after ``keep_alive_timeout`` does the
server close its socket. Meanwhile the socket sits in CLOSE-WAIT holding a descriptor: a
client that opens one connection per request exhausts a 256-descriptor limit in seconds.
Which side wins the race (the client's FIN before or after the server recycles the
connection) depends on scheduling, so asyncio shows it nearly always and Trio sometimes.

The fix is one line: once the read loop ended, stop the keep-alive timer, so the task group
exits and the connection closes at once. It is applied by subclassing each flavour's
``TCPServer`` and pointing the module that instantiates it at the subclass; an already
fixed Hypercorn is unaffected (stopping a stopped timer does nothing).
"""

from __future__ import annotations

import hypercorn.asyncio.run
import hypercorn.asyncio.tcp_server
import hypercorn.trio.run
import hypercorn.trio.tcp_server

__all__ = ["install_eof_close"]


class _AsyncioTCPServer(hypercorn.asyncio.tcp_server.TCPServer):
    async def _read_data(self) -> None:
        await super()._read_data()
        # The peer closed (or the read failed): no keep-alive left to wait for.
        await self.idle_task.stop()


class _TrioTCPServer(hypercorn.trio.tcp_server.TCPServer):
    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


def install_eof_close() -> None:
    """Make Hypercorn close a connection as soon as its client closed it. Idempotent;
    not a checkpoint. Affects every Hypercorn server in this process, for the better."""
    hypercorn.asyncio.run.TCPServer = _AsyncioTCPServer  # type: ignore[attr-defined]
    hypercorn.trio.run.TCPServer = _TrioTCPServer  # type: ignore[attr-defined]
