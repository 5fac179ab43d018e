"""How the vLLM wire's shared-storage connector gets a staged part's bytes into this
process: the Encoder's own push, to a loopback socket bound for that one part.

The Encoder (or a data-parallel worker) counts the loopback socket as the part's one
destination, pushes ``[our header, bytes]`` there as to any receiver, and releases the part
once ZMQ let go of it; the connector then writes the bytes as a file. The same path serves
one Encoder and data-parallel workers alike, and the Encoder's staged-memory ownership is
untouched: the part is freed by its own scope, after its push.
"""

from __future__ import annotations

import logging

import anyio

from ..._errors import BadRequestError, InternalError, TransferError
from ...encoder import ZmqDestination
from ...nurseries import collapse_single_error
from ...transfer import ReceivedPart, ZmqReceiver
from .._backend import Backend
from .._messages import SendBody

__all__ = ["relay_staged"]

_log = logging.getLogger("encdisagg.server.vllm")


async def relay_staged(
    backend: Backend, req_id: str, *, bind: str, timeout_s: float
) -> ReceivedPart:
    """The bytes of the staged part ``req_id`` (a tensor over the received frame).

    A checkpoint, bounded by ``timeout_s``. Binds a PULL socket on ``bind`` (a loopback
    address, port 0), asks ``backend`` to send the part there, and takes the message of that
    part; messages for other ids (none are expected) are dropped. Cancelled, the send is
    cancelled as the Encoder cancels any send: once its transfer stopped touching memory.

    :raises TransferError: nothing arrived in time.
    :raises EncdisaggError: the backend's send failed.
    """
    found: list[ReceivedPart] = []
    arrived = anyio.Event()
    async with ZmqReceiver(bind, max_payload_bytes=None) as relay:
        destination = ZmqDestination(relay.url)

        async def take() -> None:
            while True:
                try:
                    received = await relay.receive()
                except BadRequestError as exc:
                    _log.warning("dropped a malformed relay message: %s", exc)
                    continue
                if received.header.req_id == req_id:
                    found.append(received)
                    arrived.set()
                    return

        with collapse_single_error():
            async with anyio.create_task_group() as group:
                group.start_soon(take)
                with anyio.move_on_after(timeout_s):
                    await backend.send(SendBody(req_id, destination, 1))
                    await arrived.wait()
                group.cancel_scope.cancel()
    if not found:
        raise TransferError(
            f"req_id {req_id!r}: the staged embedding did not reach the relay within {timeout_s} s",
            req_id=req_id,
        )
    part = found[0]
    if part.header.error is not None:
        # A send delivers staged parts only (a failed encode raises instead): a broken promise.
        raise InternalError(f"req_id {req_id!r}: the relay got an error part", req_id=req_id)
    return part
