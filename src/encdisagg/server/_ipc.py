"""Control messages between the data-parallel front and its workers: msgpack over ZMQ IPC.

Sockets are plain non-blocking ZMQ sockets whose ``ZMQ_FD`` is awaited with
:func:`anyio.wait_readable`, so they work on asyncio and Trio alike. That descriptor is
edge-triggered and signals any change of ``ZMQ_EVENTS``, so the events are re-read before
every wait. Nothing is unpickled: every message is a msgpack map decoded into a frozen
message type that rejects unknown fields and wrong types.

Channels (the front binds, workers connect):

- ``work-R`` (front PUSH → worker R PULL): :class:`WorkMessage`, one per call.
- ``control-R`` (front PUSH → worker R PULL): :class:`ControlMessage`: cancel a call,
  release a request, stop. Separate from the work channel, so cleanup never queues behind
  work.
- ``results`` (every worker PUSH → front PULL): :class:`ReplyMessage`: a call's outcome, or
  a worker's readiness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Self, cast

import anyio
import anyio.lowlevel
import msgpack
import zmq

from .._errors import (
    BadRequestError,
    EncdisaggError,
    InternalError,
    NotFoundError,
    RequestNotActiveError,
    RequestTimeoutError,
    ServiceUnavailableError,
    TransferError,
)

__all__ = [
    "CONTROL_OPS",
    "WORK_OPS",
    "ControlMessage",
    "IpcSocket",
    "MalformedMessage",
    "ReplyMessage",
    "WorkMessage",
    "error_from_wire",
    "error_to_wire",
    "pack",
    "unpack",
]

#: Largest message a worker or the front accepts (media travel inside encode calls).
MAX_MESSAGE_BYTES: Final = 1024 * 1024 * 1024

WORK_OPS: Final = frozenset(
    {"encode", "send", "register", "metadata", "release", "health", "stats"}
)
CONTROL_OPS: Final = frozenset({"cancel", "release", "stop"})
#: Longest startup failure reason a worker reports (one line for the user).
_MAX_REASON_CHARS: Final = 2000

_ERRORS: Final[dict[str, type[EncdisaggError]]] = {
    cls.__name__: cls
    for cls in (
        EncdisaggError,
        BadRequestError,
        NotFoundError,
        RequestNotActiveError,
        RequestTimeoutError,
        TransferError,
        ServiceUnavailableError,
        InternalError,
    )
}


class MalformedMessage(ValueError):
    """A message that is not valid msgpack or does not fit its message type."""


def pack(value: dict[str, Any]) -> bytes:
    """Encode a message map as msgpack."""
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def unpack(data: bytes) -> dict[str, Any]:
    """Decode a msgpack map; never runs code and never builds objects but plain values.

    :raises MalformedMessage: if ``data`` is not one msgpack map with string keys.
    """
    try:
        # Sizes are bounded by ZMQ_MAXMSGSIZE on the receiving socket.
        value = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises ValueError, ExtraData, FormatError, ...
        raise MalformedMessage(f"not a msgpack message: {exc!r}") from exc
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise MalformedMessage(f"expected a map with string keys, got {type(value).__name__}")
    return value


def _fields(value: dict[str, Any], what: str, required: set[str], optional: set[str]) -> None:
    keys = set(value)
    if not required <= keys:
        raise MalformedMessage(f"{what} lacks {sorted(required - keys)}")
    if not keys <= required | optional:
        raise MalformedMessage(f"{what} has unknown fields {sorted(keys - required - optional)}")


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedMessage(f"{name} must be an integer >= 0")
    return value


def _str(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise MalformedMessage(f"{name} must be a non-empty string")
    return value


@dataclass(frozen=True, slots=True)
class WorkMessage:
    """One call for a worker: ``op`` with ``args`` (a route's body map, or empty)."""

    id: int
    op: str
    args: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "op": self.op, "args": self.args}

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> Self:
        """:raises MalformedMessage: if ``value`` does not fit."""
        _fields(value, "work message", {"id", "op", "args"}, set())
        op = _str(value["op"], "op")
        if op not in WORK_OPS:
            raise MalformedMessage(f"unknown work op {op!r}")
        args = value["args"]
        if not isinstance(args, dict):
            raise MalformedMessage("args must be a map")
        return cls(_int(value["id"], "id"), op, args)


@dataclass(frozen=True, slots=True)
class ControlMessage:
    """``cancel`` call ``id``; ``release`` request ``req_id``; or ``stop``."""

    op: str
    id: int | None = None
    req_id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"op": self.op}
        if self.id is not None:
            wire["id"] = self.id
        if self.req_id is not None:
            wire["req_id"] = self.req_id
        return wire

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> Self:
        """:raises MalformedMessage: if ``value`` does not fit."""
        op = value.get("op")
        if op == "cancel":
            _fields(value, "cancel message", {"op", "id"}, set())
            return cls("cancel", id=_int(value["id"], "id"))
        if op == "release":
            _fields(value, "release message", {"op", "req_id"}, set())
            return cls("release", req_id=_str(value["req_id"], "req_id"))
        if op == "stop":
            _fields(value, "stop message", {"op"}, set())
            return cls("stop")
        raise MalformedMessage(f"unknown control op {op!r}")


def error_to_wire(error: EncdisaggError) -> dict[str, Any]:
    """An error as a map: its class name, status, message and ``req_id``."""
    name = type(error).__name__
    if name not in _ERRORS:
        name = next(
            (base.__name__ for base in type(error).__mro__ if base.__name__ in _ERRORS),
            "InternalError",
        )
    return {"type": name, "message": error.message, "req_id": error.req_id}


def error_from_wire(value: object) -> EncdisaggError:
    """Rebuild an error from :func:`error_to_wire`'s map (one of ours, never arbitrary).

    :raises MalformedMessage: if ``value`` does not fit.
    """
    if not isinstance(value, dict):
        raise MalformedMessage("error must be a map")
    _fields(value, "error", {"type", "message", "req_id"}, set())
    cls = _ERRORS.get(cast(str, value["type"]))
    if cls is None:
        raise MalformedMessage(f"unknown error type {value['type']!r}")
    message = value["message"]
    req_id = value["req_id"]
    if not isinstance(message, str) or not (req_id is None or isinstance(req_id, str)):
        raise MalformedMessage("error message must be a string and req_id a string or null")
    return cls(message, req_id=req_id)


@dataclass(frozen=True, slots=True)
class ReplyMessage:
    """From a worker: ``kind="result"`` of call ``id`` (``value`` or ``error``),
    ``kind="ready"`` once its Encoder is open, or ``kind="failed"`` (``reason``, one line)
    if it could not open it."""

    kind: str
    rank: int
    id: int | None = None
    value: Any = None
    error: EncdisaggError | None = None
    pid: int | None = None
    reason: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"kind": self.kind, "rank": self.rank}
        if self.kind == "ready":
            wire["pid"] = self.pid
            return wire
        if self.kind == "failed":
            wire["reason"] = self.reason
            return wire
        wire["id"] = self.id
        if self.error is not None:
            wire["error"] = error_to_wire(self.error)
        else:
            wire["value"] = self.value
        return wire

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> Self:
        """:raises MalformedMessage: if ``value`` does not fit."""
        kind = value.get("kind")
        if kind == "ready":
            _fields(value, "ready message", {"kind", "rank", "pid"}, set())
            return cls("ready", _int(value["rank"], "rank"), pid=_int(value["pid"], "pid"))
        if kind == "failed":
            _fields(value, "failed message", {"kind", "rank", "reason"}, set())
            reason = value["reason"]
            if not isinstance(reason, str):
                raise MalformedMessage("reason must be a string")
            return cls("failed", _int(value["rank"], "rank"), reason=reason[:_MAX_REASON_CHARS])
        if kind == "result":
            _fields(value, "result message", {"kind", "rank", "id"}, {"value", "error"})
            if ("value" in value) == ("error" in value):
                raise MalformedMessage("a result has either a value or an error")
            error = error_from_wire(value["error"]) if "error" in value else None
            return cls(
                "result",
                _int(value["rank"], "rank"),
                id=_int(value["id"], "id"),
                value=value.get("value"),
                error=error,
            )
        raise MalformedMessage(f"unknown reply kind {kind!r}")


class IpcSocket:
    """One non-blocking ZMQ socket used from one event loop.

    Sends and receives are checkpoints and cancellable: a message is handed to ZMQ or taken
    from it only after the last checkpoint. Tasks take turns waiting on the descriptor
    (both backends allow one waiter per descriptor).
    """

    def __init__(
        self, context: zmq.Context[Any], kind: int, url: str, *, bind: bool, hwm: int = 10_000
    ) -> None:
        sock = context.socket(kind)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            if bind:
                sock.bind(url)
            else:
                sock.connect(url)
            self._fd = cast(int, sock.getsockopt(zmq.FD))
        except BaseException:
            sock.close(linger=0)
            raise
        self._socket: zmq.Socket[Any] | None = sock
        self.url = url
        self._lock = anyio.Lock()

    def _require(self) -> zmq.Socket[Any]:
        if self._socket is None:
            raise anyio.ClosedResourceError
        return self._socket

    def send_nowait(self, message: dict[str, Any]) -> bool:
        """Hand ``message`` to ZMQ if it takes it at once; ``False`` if it would block (no
        peer, or the queue is full) or the socket is closed. Not a checkpoint."""
        sock = self._socket
        if sock is None:
            return False
        try:
            sock.send(pack(message), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def send(self, message: dict[str, Any]) -> None:
        """Send ``message``, waiting while ZMQ cannot take it (bound it with a timeout).

        :raises anyio.ClosedResourceError: if the socket is (or gets) closed.
        """
        data = pack(message)
        await anyio.lowlevel.checkpoint()
        async with self._lock:
            while True:
                sock = self._require()
                try:
                    sock.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
                await self._wait(sock, zmq.POLLOUT)

    async def receive(self) -> bytes:
        """Wait for the next message and return its bytes.

        :raises anyio.ClosedResourceError: if the socket is (or gets) closed.
        """
        await anyio.lowlevel.checkpoint()
        async with self._lock:
            while True:
                sock = self._require()
                try:
                    data: bytes = sock.recv(zmq.NOBLOCK)
                    return data
                except zmq.Again:
                    pass
                await self._wait(sock, zmq.POLLIN)

    async def _wait(self, sock: zmq.Socket[Any], event: int) -> None:
        while not cast(int, sock.getsockopt(zmq.EVENTS)) & event:
            await anyio.wait_readable(self._fd)

    def close(self, *, linger_ms: int = 0) -> None:
        """Close the socket; a task waiting on it gets ``ClosedResourceError``. Messages
        still queued are kept for up to ``linger_ms`` (blocking the close that long at
        most). Idempotent; not a checkpoint."""
        sock, self._socket = self._socket, None
        if sock is not None:
            anyio.notify_closing(self._fd)
            sock.close(linger=linger_ms)
