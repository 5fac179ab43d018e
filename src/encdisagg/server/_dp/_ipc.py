"""Control messages between the data-parallel front and its workers: msgpack over ZMQ IPC.

Sockets are plain non-blocking ZMQ sockets whose ``ZMQ_FD`` is awaited with
:func:`anyio.wait_readable`, so they work on asyncio and Trio alike. That descriptor is
edge-triggered and signals any change of ``ZMQ_EVENTS``, so the events are re-read before
every wait. Nothing is unpickled: every message is a msgpack map decoded into a frozen
message type that rejects unknown fields and wrong types. The decoding is msgspec's, from the
bytes straight to a typed message (about 6x faster than unpacking a map and checking it by
hand, ``benchmarks/bench_decoders.py``).

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
from typing import Annotated, Any, Final, Literal, Self, cast, get_args

import anyio
import anyio.lowlevel
import msgpack
import msgspec
import zmq

from ..._errors import (
    BadRequestError,
    EncdisaggError,
    InternalError,
    NotFoundError,
    RequestNotActiveError,
    RequestTimeoutError,
    ServiceUnavailableError,
    TransferError,
    TransferTimeoutError,
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

WorkOp = Literal["encode", "send", "register", "metadata", "release", "health", "stats"]
WORK_OPS: Final = frozenset(get_args(WorkOp))
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
        TransferTimeoutError,
        ServiceUnavailableError,
        InternalError,
    )
}


_ErrorName = Literal[
    "EncdisaggError",
    "BadRequestError",
    "NotFoundError",
    "RequestNotActiveError",
    "RequestTimeoutError",
    "TransferError",
    "TransferTimeoutError",
    "ServiceUnavailableError",
    "InternalError",
]
assert frozenset(get_args(_ErrorName)) == _ERRORS.keys()


class MalformedMessage(ValueError):
    """A message that is not valid msgpack or does not fit its message type."""


# -- the schemas msgspec decodes into (strict: no bools as ints, no unknown fields) ----------

#: Call ids, ranks and pids: integers >= 0 (msgspec's bounds stop at int64).
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Name = Annotated[str, msgspec.Meta(min_length=1)]


class _Work(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: _Count
    op: WorkOp
    args: dict[str, Any]
    traceparent: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None


class _Cancel(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", tag="cancel"
):
    id: _Count


class _Release(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", tag="release"
):
    req_id: _Name


class _Stop(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", tag="stop"):
    pass


class _Error(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: _ErrorName
    message: str
    req_id: str | None


class _Ready(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="ready"
):
    rank: _Count
    pid: _Count


class _Failed(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="failed"
):
    rank: _Count
    reason: str


class _Result(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="result"
):
    rank: _Count
    id: _Count
    # UNSET tells an absent field from an explicit nil value.
    value: Any = msgspec.UNSET
    error: _Error | msgspec.UnsetType = msgspec.UNSET


_Control = _Cancel | _Release | _Stop
_Reply = _Ready | _Failed | _Result


def _no_ext(code: int, data: memoryview) -> object:
    raise ValueError(f"msgpack extension type {code} is not allowed")


_WORK: Final = msgspec.msgpack.Decoder(_Work, ext_hook=_no_ext)
_CONTROL: Final = msgspec.msgpack.Decoder(_Control, ext_hook=_no_ext)
_REPLY: Final = msgspec.msgpack.Decoder(_Reply, ext_hook=_no_ext)


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes, what: str) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, ValueError) as exc:  # ValidationError is a DecodeError
        raise MalformedMessage(f"{what}: {exc}") from None


def _convert(value: object, schema: Any, what: str) -> Any:
    try:
        return msgspec.convert(value, schema, strict=True)
    except msgspec.ValidationError as exc:
        raise MalformedMessage(f"{what}: {exc}") from None


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


@dataclass(frozen=True, slots=True)
class WorkMessage:
    """One call for a worker: ``op`` with ``args`` (a route's body map, or empty), and the
    caller's ``traceparent`` when it is traced (the worker's spans continue its trace)."""

    id: int
    op: str
    args: dict[str, Any]
    traceparent: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"id": self.id, "op": self.op, "args": self.args}
        if self.traceparent is not None:
            wire["traceparent"] = self.traceparent
        return wire

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """The message in ``data`` (msgpack). :raises MalformedMessage: if it does not fit."""
        return cls._build(_decode(_WORK, data, "work message"))

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> Self:
        """:raises MalformedMessage: if ``value`` does not fit."""
        return cls._build(_convert(value, _Work, "work message"))

    @classmethod
    def _build(cls, work: _Work) -> Self:
        return cls(work.id, work.op, work.args, work.traceparent)


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
    def decode(cls, data: bytes) -> Self:
        """The message in ``data`` (msgpack). :raises MalformedMessage: if it does not fit."""
        return cls._build(_decode(_CONTROL, data, "control message"))

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> Self:
        """:raises MalformedMessage: if ``value`` does not fit."""
        return cls._build(_convert(value, _Control, "control message"))

    @classmethod
    def _build(cls, control: _Control) -> Self:
        if isinstance(control, _Cancel):
            return cls("cancel", id=control.id)
        if isinstance(control, _Release):
            return cls("release", req_id=control.req_id)
        return cls("stop")


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
    return _error(_convert(value, _Error, "error"))


def _error(error: _Error) -> EncdisaggError:
    return _ERRORS[error.type](error.message, req_id=error.req_id)


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
    def decode(cls, data: bytes) -> Self:
        """The message in ``data`` (msgpack). :raises MalformedMessage: if it does not fit."""
        return cls._build(_decode(_REPLY, data, "reply message"))

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> Self:
        """:raises MalformedMessage: if ``value`` does not fit."""
        return cls._build(_convert(value, _Reply, "reply message"))

    @classmethod
    def _build(cls, reply: _Reply) -> Self:
        if isinstance(reply, _Ready):
            return cls("ready", reply.rank, pid=reply.pid)
        if isinstance(reply, _Failed):
            return cls("failed", reply.rank, reason=reply.reason[:_MAX_REASON_CHARS])
        has_value = reply.value is not msgspec.UNSET
        if has_value == isinstance(reply.error, _Error):
            raise MalformedMessage("a result has either a value or an error")
        if isinstance(reply.error, _Error):
            return cls("result", reply.rank, id=reply.id, error=_error(reply.error))
        return cls("result", reply.rank, id=reply.id, value=reply.value)


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
