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

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, ClassVar, Final, Literal, Self, TypeVar, cast, get_args

import anyio
import anyio.lowlevel
import msgpack
import msgspec
import zmq

from ... import _errors, _strict
from ..._errors import EncdisaggError

__all__ = [
    "MAX_REASON_CHARS",
    "ControlMessage",
    "IpcSocket",
    "MalformedMessage",
    "ReplyMessage",
    "WorkMessage",
    "WorkOp",
    "error_from_wire",
    "error_to_wire",
    "pack",
    "unpack",
]

#: Largest message a worker or the front accepts (media travel inside encode calls).
MAX_MESSAGE_BYTES: Final = 1024 * 1024 * 1024
#: Longest startup failure reason the front shows (one line for the user).
MAX_REASON_CHARS: Final = 2000

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
#: The error classes a reply may carry, by name: never an arbitrary class.
_ERRORS: Final[dict[str, type[EncdisaggError]]] = {
    name: getattr(_errors, name) for name in get_args(_ErrorName)
}


class MalformedMessage(ValueError):
    """A message that is not valid msgpack or does not fit its message type."""


WorkOp = Literal["encode", "send", "register", "metadata", "release", "health", "stats"]
#: Call ids, ranks and pids: integers >= 0 (msgspec's bounds stop at int64).
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Name = Annotated[str, msgspec.Meta(min_length=1)]
_T = TypeVar("_T")


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


class _Ipc(_strict.Message, frozen=True, omit_defaults=True):
    """A message of one channel: strict (no bools as ints, no unknown fields), decoded by
    msgspec from the bytes straight to the message."""

    _WHAT: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        """The message as a map for :func:`pack`."""
        # Bytes stay bytes (msgpack has a type for them; to_builtins would write base64).
        wire: dict[str, Any] = msgspec.to_builtins(
            self, builtin_types=(bytes,), enc_hook=_error_to_builtins
        )
        return wire

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """The message in ``data`` (msgpack). Not async.

        :raises MalformedMessage: if it does not fit.
        """
        message: Self = _strict.decode(_decoder(cls), data, cls._WHAT, MalformedMessage)
        return message

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> Self:
        """The message in a map as :func:`unpack` gives it.

        :raises MalformedMessage: if it does not fit.
        """
        return cls.decode(pack(value))


@functools.cache
def _decoder(cls: type[_Ipc]) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(cls, dec_hook=_error_from_builtins, ext_hook=_strict.reject_ext)


class WorkMessage(_Ipc, frozen=True):
    """One call for a worker: ``op`` with ``args`` (a route's body map, or empty), and the
    caller's ``traceparent`` when it is traced (the worker's spans continue its trace)."""

    _WHAT: ClassVar[str] = "work message"

    id: _Count
    op: WorkOp
    args: dict[str, Any]
    traceparent: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None


def _check_shape(message: _Ipc, shapes: Mapping[str, tuple[frozenset[str], ...]]) -> None:
    """Refuse a message whose optional fields are not those its first field (``op`` or
    ``kind``) calls for: ``shapes`` lists the ones each may carry (one set, or a choice)."""
    kind = getattr(message, message.__struct_fields__[0])
    defaults = message.__struct_defaults__
    optional = message.__struct_fields__[-len(defaults) :]
    given = {n for n, d in zip(optional, defaults, strict=True) if getattr(message, n) is not d}
    if given not in shapes[kind]:
        needs = " or ".join(_names(shape) for shape in shapes[kind])
        raise ValueError(f"a {kind} {message._WHAT} carries {needs}, not {_names(given)}")


def _names(fields: Iterable[str]) -> str:
    return "{" + ", ".join(sorted(fields)) + "}"


class ControlMessage(_Ipc, frozen=True):
    """``cancel`` call ``id``; ``release`` request ``req_id``; or ``stop``."""

    _WHAT: ClassVar[str] = "control message"

    op: Literal["cancel", "release", "stop"]
    id: _Count | None = None
    req_id: _Name | None = None

    def __post_init__(self) -> None:
        _check_shape(self, _CONTROL_SHAPES)


_CONTROL_SHAPES: Final = {
    "cancel": (frozenset({"id"}),),
    "release": (frozenset({"req_id"}),),
    "stop": (frozenset(),),
}


class _Error(_strict.Message, frozen=True):
    type: _ErrorName
    message: str
    req_id: str | None


def error_to_wire(error: EncdisaggError) -> dict[str, Any]:
    """An error as a map: its class name, message and ``req_id``."""
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
    error = _strict.convert(value, _Error, "the error map", MalformedMessage)
    return _ERRORS[error.type](error.message, req_id=error.req_id)


def _error_to_builtins(value: object) -> object:
    if isinstance(value, EncdisaggError):
        return error_to_wire(value)
    raise NotImplementedError(f"{type(value).__name__} is no message field")


def _error_from_builtins(kind: type, value: object) -> object:
    if kind is EncdisaggError:
        return error_from_wire(value)  # MalformedMessage is a ValueError: msgspec names it
    raise NotImplementedError(f"{kind.__name__} is no message field")


class ReplyMessage(_Ipc, frozen=True):
    """From a worker: ``kind="result"`` of call ``id`` (``value`` or ``error``),
    ``kind="ready"`` once its Encoder is open, or ``kind="failed"`` (``reason``, one line)
    if it could not open it. ``value`` and ``error`` are ``UNSET`` where not given."""

    _WHAT: ClassVar[str] = "reply message"

    kind: Literal["result", "ready", "failed"]
    rank: _Count
    id: _Count | None = None
    # UNSET tells an absent value from an explicit nil one.
    value: Any = msgspec.UNSET
    error: EncdisaggError | msgspec.UnsetType = msgspec.UNSET
    pid: _Count | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        _check_shape(self, _REPLY_SHAPES)


_REPLY_SHAPES: Final = {
    "result": (frozenset({"id", "value"}), frozenset({"id", "error"})),
    "ready": (frozenset({"pid"}),),
    "failed": (frozenset({"reason"}),),
}


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
        await self._when_ready(zmq.POLLOUT, lambda sock: sock.send(data, zmq.NOBLOCK))

    async def receive(self) -> bytes:
        """Wait for the next message and return its bytes.

        :raises anyio.ClosedResourceError: if the socket is (or gets) closed.
        """
        data: bytes = await self._when_ready(zmq.POLLIN, lambda sock: sock.recv(zmq.NOBLOCK))
        return data

    async def _when_ready(self, event: int, attempt: Callable[[zmq.Socket[Any]], _T]) -> _T:
        """``attempt`` on the socket once ZMQ can do it without blocking (``event``)."""
        await anyio.lowlevel.checkpoint()
        async with self._lock:
            while True:
                sock = self._socket
                if sock is None:
                    raise anyio.ClosedResourceError
                try:
                    return attempt(sock)
                except zmq.Again:
                    pass
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
