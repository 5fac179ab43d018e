"""``encdisagg receive --from URL PART_ID…``: fetch parts a server keeps staged, and print them.

The receiver side of the encdisagg wire, as a prefill runs it: ask the server what it staged
(``/scheduler_receive_meta_data``), then ``/send`` it here, over ZMQ to the bound socket or
over Mooncake into memory this process registered with its own engine. Each part prints the
line a pushed part prints, so the digests of the two transports can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Awaitable, Callable

import torch

from .._errors import EncdisaggError
from .._modality import Modality
from ..receiver import EncoderClient, MooncakeSendTarget, PartMetadata, ZmqSendTarget
from ..receiver._plan import PartPlan, split_part_id
from ..transfer import MooncakeEngine, ZmqReceiver, payload_view
from ._describe import describe

__all__ = ["fetch_staged", "staged_part"]

Print = Callable[[dict[str, object]], None]


def staged_part(url: str, part_id: str) -> PartPlan:
    """The part ``part_id`` (``"{rid}#{part_idx}"``, as ``encdisagg encode`` prints it) on
    the server at ``url``. Not async.

    :raises ValueError: ``part_id`` is not of that form.
    """
    rid, index = split_part_id(part_id)
    if not rid or not index.isdigit():
        raise ValueError(f"a part id is REQUEST#INDEX, e.g. cli-1a2b3c#0; got {part_id!r}")
    # Only the id and the URL take part in the calls below: the items stay on the server.
    return PartPlan(rid, int(index), int(index) + 1, Modality.IMAGE, url, (), 0)


def _line(metadata: PartMetadata, data: memoryview) -> dict[str, object]:
    return {
        "req_id": metadata.req_id,
        "shape": [metadata.embedding_len, metadata.embedding_dim],
        "bytes": metadata.embedding_size,
        "tokens": list(metadata.token_counts),
        "sha256": hashlib.sha256(data).hexdigest()[:16],
    }


async def fetch_staged(args: argparse.Namespace, parts: list[PartPlan], show: Print) -> int:
    """Fetch each of ``parts`` from ``args.source``; how many failed. A checkpoint."""
    failed = 0
    async with EncoderClient(
        [args.source],
        encode_timeout_s=args.timeout_s or 60.0,
        send_timeout_s=args.timeout_s or 60.0,
        api_key=args.api_key,
    ) as client:
        if args.transfer == "mooncake":
            async with MooncakeEngine(hostname=args.mooncake_host, protocol="tcp") as engine:
                for part in parts:
                    failed += not await _one(show, part, lambda p: _by_mooncake(client, engine, p))
        else:
            async with ZmqReceiver(args.bind) as receiver:
                for part in parts:
                    failed += not await _one(show, part, lambda p: _by_zmq(client, receiver, p))
    return failed


async def _one(
    show: Print, part: PartPlan, fetch: Callable[[PartPlan], Awaitable[dict[str, object]]]
) -> bool:
    try:
        show(await fetch(part))
    except EncdisaggError as exc:
        show({"req_id": part.req_id, "error": exc.message, "status": exc.status})
        return False
    return True


async def _by_zmq(
    client: EncoderClient, receiver: ZmqReceiver, part: PartPlan
) -> dict[str, object]:
    await client.staged(part)  # a part the server does not hold fails here, by name
    await client.send(part, ZmqSendTarget(receiver.url))
    # The send returned once the message left the server: it is on its way to this socket.
    return describe(await receiver.receive())


async def _by_mooncake(
    client: EncoderClient, engine: MooncakeEngine, part: PartPlan
) -> dict[str, object]:
    metadata = await client.staged(part)
    buffer = torch.zeros(metadata.embedding_size, dtype=torch.uint8)
    ptr = buffer.data_ptr()
    engine.register(ptr, buffer.numel())
    host, _, port = engine.session_id.rpartition(":")
    target = MooncakeSendTarget(engine.session_id, ptr, host, int(port))
    try:
        await client.send(part, target)
    except BaseException:
        # The write's outcome is unknown: the memory stays registered and referenced until
        # the engine closes, so a write still in flight lands in memory nobody reuses.
        engine.keep_until_closed(buffer, ptr)
        raise
    engine.deregister(ptr)
    return _line(metadata, payload_view(buffer))
