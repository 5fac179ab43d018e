"""Pushing frames to SGLang's PULL sockets, native to AnyIO (asyncio and Trio alike).

SGLang's receivers bind one PULL socket per request (``zmq_to_tokenizer``, the Mooncake
completion notice) or per scheduler rank (``zmq_to_scheduler``), and read a multipart
message: the pickled header frame and, for ZMQ deliveries, the raw bytes. This pusher opens
a fresh PUSH socket per message, as SGLang's own encoder does for its per-request sends,
hands the message to ZMQ (copied: the caller's memory is free on return) and closes the
socket with a linger, so ZMQ finishes writing it in the background.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, cast, final

import anyio
import zmq

from .._errors import TransferError
from ..nurseries import run_thread_to_completion
from ._zmq_socket import wait_events

__all__ = ["SglangPusher"]

#: How long a closed socket may keep writing its message in the background.
_LINGER_MS: Final = 10_000


@final
class SglangPusher(anyio.AsyncContextManagerMixin):
    """Pushes one multipart message per call to a ``tcp://host:port`` PULL endpoint.

    ``async with SglangPusher() as pusher:``; leaving the block waits (in a worker thread,
    bounded by the linger) for messages ZMQ is still writing, then ends the context.

    :param send_timeout_s: the bound on one push: a receiver that is not listening (ZMQ's
        ``IMMEDIATE`` holds the message until a connection completes) fails the push.
    """

    def __init__(self, *, send_timeout_s: float = 30.0) -> None:
        self._send_timeout_s = send_timeout_s
        self._context: zmq.Context[Any] | None = None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[SglangPusher]:
        self._context = zmq.Context()
        try:
            yield self
        finally:
            context, self._context = self._context, None
            with anyio.CancelScope(shield=True):
                # term() waits for lingering messages (each bounded by its linger).
                await run_thread_to_completion(context.term)

    async def push(
        self,
        url: str,
        frames: Sequence[bytes | memoryview],
        *,
        what: str,
        timeout_s: float | None = None,
    ) -> None:
        """Queue ``frames`` as one message to ``url``; return once ZMQ holds a copy.

        A checkpoint, bounded by ``timeout_s`` (default: ``send_timeout_s``). Cancelled,
        nothing was queued (or the whole message was: ZMQ queues a message in one step).
        ZMQ has no acknowledgments: the receiver's own timeout is what notices a message
        lost in flight.

        :raises TransferError: the pusher is closed, the endpoint cannot be connected,
            or no connection completed within the bound.
        """
        context = self._context
        if context is None:
            raise TransferError(f"{what}: the SGLang pusher is closed")
        try:
            sock = context.socket(zmq.PUSH)
        except zmq.ZMQError as exc:
            raise TransferError(f"{what}: cannot open a socket: {exc}") from exc
        linger = 0
        bound = self._send_timeout_s if timeout_s is None else timeout_s
        try:
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(url)
            fd = cast(int, sock.getsockopt(zmq.FD))
            with anyio.fail_after(bound):
                while True:
                    await wait_events(sock, fd, zmq.POLLOUT)
                    try:
                        sock.send_multipart(list(frames), zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        continue
                    break
            linger = _LINGER_MS
        except TimeoutError:
            raise TransferError(f"{what}: nobody took the message within {bound} s") from None
        except zmq.ZMQError as exc:
            raise TransferError(f"{what} failed: {exc}") from exc
        finally:
            sock.close(linger=linger)
