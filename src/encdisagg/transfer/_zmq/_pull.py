"""Embedding pull over ZMQ, native to AnyIO (asyncio and Trio alike).

The receiving end of :class:`~encdisagg.transfer.ZmqPushPool`: a plain non-blocking PULL
socket whose ``ZMQ_FD`` is awaited with :func:`anyio.wait_readable` (edge-triggered, so
``ZMQ_EVENTS`` is read before every wait and after every wake-up). Headers are decoded
strictly; nothing received is ever unpickled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Any, Final, cast, final

import anyio
import anyio.lowlevel
import torch
import zmq

from ..._errors import BadRequestError, TransferError
from ..._numbers import whole
from ...nurseries import run_thread_to_completion
from .._wire import MAX_HEADER_BYTES, EmbeddingHeader, decode_header, tensor_from_frame
from ._curve import curve_key, require_curve, secure_server
from ._socket import wait_events

__all__ = ["DEFAULT_MAX_PAYLOAD_BYTES", "ReceivedPart", "ZmqReceiver"]

#: The default bound on one payload frame: larger ones are refused before ZMQ buffers them.
DEFAULT_MAX_PAYLOAD_BYTES: Final = 128 * 1024 * 1024


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class ReceivedPart:
    """One validated embedding message.

    ``tensor`` is the ``header.shape`` tensor over the received frame's memory (no copy),
    or ``None`` for an error part.
    """

    header: EmbeddingHeader
    tensor: torch.Tensor | None


@final
class ZmqReceiver(anyio.AsyncContextManagerMixin):
    """A PULL socket that receives embedding messages (DESIGN §5.2).

    ``async with ZmqReceiver() as rx:`` binds; ``rx.url`` is then the endpoint to give to
    senders, with the real port. Leaving the block closes the socket; a task still waiting
    in :meth:`receive` then gets :class:`anyio.ClosedResourceError`.

    :param bind: the endpoint to bind; port 0 picks a free port.
    :param max_payload_bytes: the largest frame taken (``ZMQ_MAXMSGSIZE``): ZMQ reads a
        frame's size before its bytes and drops the connection of a peer that announces a
        larger one, so such a frame is never buffered. ``None``: no limit.
    :param max_queued_messages: the receive high-water mark: how many messages ZMQ buffers
        ahead of :meth:`receive` (per sender) before that sender waits.
    :param context: a plain (blocking) ``zmq.Context``; a private one if omitted.
    :param curve_secret_key: this receiver's CURVE secret key (Z85): it then binds as a
        CURVE server, and only senders holding its public key (:attr:`curve_public_key`)
        complete the handshake; every message is encrypted and authenticated.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
        max_queued_messages: int = 16,
        context: zmq.Context[Any] | None = None,
        curve_secret_key: str | bytes | None = None,
    ) -> None:
        if max_payload_bytes is not None:
            whole("max_payload_bytes", max_payload_bytes)
        self._curve_secret = None
        if curve_secret_key is not None:
            require_curve()
            self._curve_secret = curve_key(curve_secret_key, "curve_secret_key")
        #: The key senders need to reach this receiver (Z85), with CURVE; else ``None``.
        self.curve_public_key: bytes | None = (
            None if self._curve_secret is None else zmq.curve_public(self._curve_secret)
        )
        self._bind = bind
        self._max_payload_bytes = max_payload_bytes
        self._max_queued = max_queued_messages
        self._context = context
        self._owns_context = context is None
        self._socket: zmq.Socket[Any] | None = None
        self._fd = -1
        self._url: str | None = None
        self._closed = False
        # One task at a time waits on the socket's descriptor (both backends insist).
        self._receive_lock = anyio.Lock()

    @property
    def url(self) -> str:
        """The bound endpoint, with the real port (``ZMQ_LAST_ENDPOINT``).

        :raises RuntimeError: before the receiver is entered.
        """
        if self._url is None:
            raise RuntimeError("ZmqReceiver.url is known once the receiver is entered")
        return self._url

    async def receive(self) -> ReceivedPart:
        """Wait for the next message and validate it.

        A checkpoint. A message is taken off the socket only after the last checkpoint, so
        cancelling a waiting call loses nothing. Concurrent calls take turns. A malformed
        message is consumed and reported; the next call receives the next message.

        :raises BadRequestError: for a malformed message (bad header, wrong frame count, a
            payload whose size does not match the header or exceeds ``max_payload_bytes``).
        :raises anyio.ClosedResourceError: if the receiver is (or gets) closed.
        :raises TransferError: on a ZMQ error.
        """
        async with self._receive_lock:
            sock = self._socket
            if sock is None or self._closed:
                raise anyio.ClosedResourceError
            try:
                while True:
                    await wait_events(sock, self._fd, zmq.POLLIN)
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        continue
                    break
            except zmq.ZMQError as exc:
                raise TransferError(f"ZMQ receive on {self._url} failed: {exc}") from exc
        return self._parse(frames)

    async def aclose(self) -> None:
        """Close the socket (and a private context). Idempotent; shielded."""
        self._closed = True
        sock, self._socket = self._socket, None
        if sock is not None:
            anyio.notify_closing(self._fd)
            sock.close(linger=0)
        if self._owns_context and self._context is not None:
            context, self._context = self._context, None
            with anyio.CancelScope(shield=True):
                await run_thread_to_completion(context.destroy, 0)

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[ZmqReceiver]:
        """Entering binds (not a checkpoint); exiting is :meth:`aclose`."""
        if self._closed or self._socket is not None:
            raise RuntimeError("a ZmqReceiver is entered once")
        try:
            self._open()
            yield self
        finally:
            await self.aclose()

    def _open(self) -> None:
        if self._context is None:
            self._context = zmq.Context()
        sock = self._context.socket(zmq.PULL)
        self._socket = sock
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self._max_queued)
            if self._curve_secret is not None:
                secure_server(sock, self._curve_secret)
            if self._max_payload_bytes is not None:
                sock.setsockopt(zmq.MAXMSGSIZE, max(self._max_payload_bytes, MAX_HEADER_BYTES))
            sock.bind(self._bind)
            self._url = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._fd = cast(int, sock.getsockopt(zmq.FD))
        except zmq.ZMQError as exc:
            raise TransferError(f"ZMQ bind of {self._bind} failed: {exc}") from exc

    def _parse(self, frames: list[zmq.Frame]) -> ReceivedPart:
        if len(frames) not in (1, 2):
            raise BadRequestError(
                f"embedding message has {len(frames)} frames; expected a header and a payload, "
                "or a header alone for an error part"
            )
        header = decode_header(frames[0].buffer)
        where = f"req_id {header.req_id!r} part {header.part_idx}"
        if header.error is not None:
            if len(frames) != 1:
                raise BadRequestError(
                    f"error part of {where} carries a payload", req_id=header.req_id
                )
            return ReceivedPart(header, None)
        if len(frames) != 2:
            raise BadRequestError(f"payload of {where} is missing", req_id=header.req_id)
        size = len(frames[1].buffer)
        if self._max_payload_bytes is not None and size > self._max_payload_bytes:
            raise BadRequestError(
                f"payload of {where} is {size} bytes; the limit is {self._max_payload_bytes}",
                req_id=header.req_id,
            )
        return ReceivedPart(header, tensor_from_frame(header, frames[1].buffer))
