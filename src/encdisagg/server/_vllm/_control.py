"""The control channel of vLLM's ``ECMooncakeConnector``: one-frame JSON over ZMQ REQ/REP.

Each exchange opens its own REQ socket to the shard, sends one JSON object and waits for one
JSON object back: ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``. A
REQ socket whose answer did not come is unusable (it must receive before it sends again),
so a socket per exchange is also what makes every exchange bounded on its own.

Waiting is AnyIO-native (on the socket's descriptor, as the transfer layer's push sockets
wait), so it runs on asyncio and Trio alike; nothing blocks the event loop. Answers are decoded as
JSON only, and bounded in size.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Any, Final, cast

import anyio
import anyio.lowlevel
import zmq

from ..._errors import TransferError, TransferTimeoutError
from ...transfer._zmq._socket import wait_events

__all__ = ["ControlChannel", "ControlError", "control_result"]

#: Largest answer taken (a reserve batch of many items is a few kilobytes).
_MAX_ANSWER_BYTES: Final = 1 << 20


class ControlError(TransferError):
    """A shard answered ``ok: false``, or something that is not a control answer."""

    status = 500


class ControlChannel(anyio.AsyncContextManagerMixin):
    """Exchanges with the shards of vLLM's Mooncake consumers.

    ``async with ControlChannel(timeout_s) as channel:`` owns a ZMQ context; leaving closes
    it (sockets are closed by their own exchanges).

    :param timeout_s: the bound on one exchange (connect, send, answer).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._context: zmq.Context[Any] | None = None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[ControlChannel]:
        await anyio.lowlevel.checkpoint()
        context: zmq.Context[Any] = zmq.Context()
        self._context = context
        try:
            yield self
        finally:
            self._context = None
            context.destroy(linger=0)

    async def request(self, address: str, payload: dict[str, Any]) -> Any:
        """Send ``payload`` to ``address`` (``tcp://host:port``) and return the answer's
        ``result``.

        A checkpoint, bounded by ``timeout_s``. Cancelled, the socket is closed at once
        (a REQ exchange cannot be resumed); the shard's answer, if any, is dropped.

        :raises ControlError: the shard answered ``ok: false`` (its error is quoted), or
            an answer that is not a JSON object.
        :raises TransferTimeoutError: no answer within ``timeout_s``.
        """
        context = self._context
        if context is None:
            raise TransferError("the vLLM control channel is closed")
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_ANSWER_BYTES)
        fd = cast(int, sock.getsockopt(zmq.FD))
        try:
            sock.connect(address)
            with anyio.move_on_after(self.timeout_s) as scope:
                await wait_events(sock, fd, zmq.POLLOUT)
                sock.send(json.dumps(payload).encode(), zmq.NOBLOCK)
                await wait_events(sock, fd, zmq.POLLIN)
                frame = cast(bytes, sock.recv(zmq.NOBLOCK))
        except zmq.ZMQError as exc:
            raise TransferError(f"{payload.get('op')} to {address}: {exc}") from None
        finally:
            sock.close(linger=0)
        if scope.cancelled_caught:
            raise TransferTimeoutError(
                f"{payload.get('op')} to {address}: no answer within {self.timeout_s} s"
            )
        try:
            answer = json.loads(frame)
        except (UnicodeDecodeError, ValueError):
            answer = None
        return control_result(answer, payload.get("op"), address)


def control_result(answer: object, op: object, address: str) -> Any:
    """The ``result`` of ``{"ok": true, "result": ...}``: a whole answer, or one item of a
    batch's. Not async.

    :raises ControlError: ``ok: false`` (its error quoted), or no such object at all.
    """
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        raise ControlError(f"{op} to {address}: the answer is not a control answer")
    if not answer["ok"]:
        error = answer.get("error")
        text = error[:300] if isinstance(error, str) else "no reason given"
        raise ControlError(f"{op} to {address} failed: {text}")
    return answer.get("result")
