"""SGLang's ``SglangEncoder`` gRPC service over the SGLang wire's dict bodies.

Each RPC turns its protobuf request into the body SGLang's HTTP language side would have
posted, hands it to the server's event loop (see :mod:`._grpc_server`), and turns the answer back
into the protobuf response. Errors map as SGLang's own gRPC encoder maps them: a
:class:`~encdisagg.BadRequestError` is ``INVALID_ARGUMENT``, anything else ``INTERNAL``, but
for what SGLang does not tell apart (the table is ``encdisagg._errors.WIRE_ANSWERS``).

Everything here runs on the gRPC server's own asyncio loop; nothing of it touches the
Encoder directly.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol

import grpc
from smg_grpc_proto.generated import sglang_encoder_pb2 as pb

from ..._errors import EncdisaggError, grpc_code_of
from .._access import ApiKey
from .._json import public_message

__all__ = [
    "SERVICE_NAME",
    "RunOnServer",
    "SglangCalls",
    "SglangEncoderServicer",
    "encode_body",
    "encode_response",
    "receive_url_body",
    "send_body",
]

_log = logging.getLogger("encdisagg.server")

#: The full name of the service, as reflection and the health service know it.
SERVICE_NAME: Final = "sglang.grpc.encoder.SglangEncoder"
#: SGLang's gRPC encoder is image-only: its EncodeRequest has no modality field.
_GRPC_MODALITY: Final = "IMAGE"

Body = Mapping[str, object]


class SglangCalls(Protocol):
    """What the RPCs call: the SGLang wire's three language-side calls.

    Each takes the JSON-shaped body SGLang's HTTP client would post and raises the
    project's error hierarchy.
    """

    async def encode(self, body: Body) -> object: ...

    async def send(self, body: Body) -> object: ...

    async def scheduler_receive_url(self, body: Body) -> object: ...


class RunOnServer(Protocol):
    """Runs ``call(body)`` on the server's event loop and returns its result.

    Cancelling the await cancels the call and returns only once it has stopped.
    """

    def __call__(
        self, call: Callable[[Body], Awaitable[object]], body: Body
    ) -> Awaitable[object]: ...


def encode_body(request: pb.EncodeRequest) -> dict[str, object]:
    """The ``/encode`` body SGLang's HTTP client sends for ``request``. Not async.

    Protobuf has no "unset" for scalars: an empty ``prefill_host`` and an empty
    ``embedding_port`` list are what SGLang's HTTP client sends as ``null`` (the port list
    ``null`` means "destinations come from ``SchedulerReceiveUrl``").
    """
    ports = [int(port) for port in request.embedding_port]
    return {
        "mm_items": list(request.mm_items),
        "modality": _GRPC_MODALITY,
        "req_id": request.req_id,
        "num_parts": int(request.num_parts),
        "part_idx": int(request.part_idx),
        "prefill_host": request.prefill_host or None,
        "embedding_port": ports or None,
    }


def send_body(request: pb.SendRequest) -> dict[str, object]:
    """The ``/send`` body for ``request``. Not async.

    SendRequest carries no ``receive_count``: SGLang's gRPC encoder releases after the one
    send, which is ``receive_count`` 1. A zero ``buffer_address`` and an empty
    ``session_id`` are protobuf's "unset".
    """
    return {
        "req_id": request.req_id,
        "prefill_host": request.prefill_host or None,
        "embedding_port": int(request.embedding_port),
        "session_id": request.session_id or None,
        "buffer_address": int(request.buffer_address) or None,
        "receive_count": 1,
    }


def receive_url_body(request: pb.SchedulerReceiveUrlRequest) -> dict[str, object]:
    """The ``/scheduler_receive_url`` body for ``request``. Not async."""
    return {
        "req_id": request.req_id,
        "receive_url": request.receive_url,
        "receive_count": int(request.receive_count),
        "modality": _GRPC_MODALITY,
    }


def _size(answer: Mapping[str, object], key: str) -> int:
    value = answer.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def encode_response(answer: object) -> pb.EncodeResponse:
    """The EncodeResponse for ``/encode``'s answer: the sizes when it has them (Mooncake),
    else empty (the ZMQ modes answer ``null``). Not async."""
    if not isinstance(answer, Mapping):
        return pb.EncodeResponse()
    return pb.EncodeResponse(
        embedding_size=_size(answer, "embedding_size"),
        embedding_len=_size(answer, "embedding_len"),
        embedding_dim=_size(answer, "embedding_dim"),
    )


class SglangEncoderServicer:
    """The ``SglangEncoder`` servicer (register it with
    ``add_SglangEncoderServicer_to_server``).

    :param calls: what the RPCs call, on the server's loop.
    :param run_on_server: hands a call to the server's loop (cancellation follows the RPC).
    :param api_key: when set, each RPC needs ``authorization: Bearer KEY`` metadata
        (``UNAUTHENTICATED`` otherwise), as each HTTP route does.
    """

    def __init__(
        self, calls: SglangCalls, run_on_server: RunOnServer, api_key: ApiKey | None = None
    ) -> None:
        self._calls = calls
        self._run = run_on_server
        self._api_key = api_key

    async def _answer(
        self,
        name: str,
        call: Callable[[Body], Awaitable[object]],
        body: Body,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> object:
        """``call(body)`` on the server's loop; an error aborts the RPC with its status.

        A checkpoint. If the RPC is cancelled (client gone, deadline), the call is
        cancelled and this returns (raises) once it stopped.
        """
        if self._api_key is not None:
            authorization = dict(context.invocation_metadata() or ()).get("authorization")
            if not self._api_key.allows(authorization if isinstance(authorization, str) else None):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        try:
            return await self._run(call, body)
        except EncdisaggError as exc:
            # WIRE_ANSWERS' code; the message scrubbed of object reprs (addresses of this
            # process) and bounded, as the HTTP routes' answers are.
            code, details = grpc.StatusCode[grpc_code_of(exc)], public_message(exc.message)
        except Exception as exc:
            # Its text is logged, never answered.
            _log.error("gRPC %s failed unexpectedly", name, exc_info=exc)
            code, details = grpc.StatusCode.INTERNAL, "internal server error"
        await context.abort(code, details)
        raise AssertionError("unreachable: abort raises")

    async def Encode(
        self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EncodeResponse:
        answer = await self._answer("Encode", self._calls.encode, encode_body(request), context)
        return encode_response(answer)

    async def Send(
        self, request: pb.SendRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SendResponse:
        await self._answer("Send", self._calls.send, send_body(request), context)
        return pb.SendResponse()

    async def SchedulerReceiveUrl(
        self, request: pb.SchedulerReceiveUrlRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SchedulerReceiveUrlResponse:
        await self._answer(
            "SchedulerReceiveUrl",
            self._calls.scheduler_receive_url,
            receive_url_body(request),
            context,
        )
        return pb.SchedulerReceiveUrlResponse()
