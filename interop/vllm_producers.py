"""Producers that check the consumer harness on its own (``vllm_consumer.py --self-check``).

- Example: vLLM's own ``ECExampleConnector`` in the ``ec_producer`` role saves the tensor
  (``save_caches``), the file its consumer then looks for.
- Mooncake: a minimal producer of the consumer's reservation protocol as vLLM documents it
  (``peers``, ``reserve`` on every shard, one Mooncake write per shard, ``complete_batch``;
  ``cancel`` with ``abandon`` on failure), over Mooncake's TCP transport.

Neither is the encoder under test; they only show the harness loads what a correct producer
delivers, so a failing row against an encoder points at the encoder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import zmq

#: Bound on one control exchange with the consumer.
CONTROL_TIMEOUT_MS = 5000


def example_save(model: Path, storage: Path, identifier: str, tensor: torch.Tensor) -> None:
    """Write ``tensor`` for ``identifier`` with vLLM's own Example producer (blocking)."""
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.engine.arg_utils import EngineArgs

    ec = ECTransferConfig(
        ec_connector="ECExampleConnector",
        ec_role="ec_producer",
        ec_connector_extra_config={"shared_storage_path": str(storage)},
    )
    config = EngineArgs(
        model=str(model), ec_transfer_config=ec, enforce_eager=True, max_model_len=4096
    ).create_engine_config()
    producer = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    producer.save_caches({identifier: tensor}, identifier)


def _request(context: zmq.Context[Any], addr: str, payload: dict[str, Any]) -> Any:
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, CONTROL_TIMEOUT_MS)
    socket.setsockopt(zmq.SNDTIMEO, CONTROL_TIMEOUT_MS)
    try:
        socket.connect(addr)
        socket.send_string(json.dumps(payload))
        answer = json.loads(socket.recv_string())
    finally:
        socket.close()
    if not answer.get("ok"):
        raise RuntimeError(f"{payload['op']}: {answer.get('error')}")
    return answer["result"]


def mooncake_push(
    consumer_zmq: str, items: list[tuple[str, str, torch.Tensor]]
) -> list[dict[str, Any]]:
    """Push each ``(transfer_id, identifier, tensor)`` to every shard of the consumer at
    ``consumer_zmq`` (blocking); returns the reservations' results."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake engine did not start")
    context = zmq.Context()
    host = consumer_zmq.rsplit(":", 1)[0]
    results: list[dict[str, Any]] = []
    sources = [tensor.contiguous().view(torch.uint8).flatten() for _, _, tensor in items]
    for source in sources:
        if engine.register_memory(source.data_ptr(), source.numel()) != 0:
            raise RuntimeError("Mooncake could not register the source")
    try:
        ports = _request(context, consumer_zmq, {"op": "peers"})["ports"]
        shards = [f"{host}:{port}" for port in ports]
        for (transfer_id, identifier, tensor), source in zip(items, sources, strict=True):
            reserve = {
                "op": "reserve",
                "transfer_id": transfer_id,
                "mm_hash": identifier,
                "nbytes": math.prod(tensor.shape) * tensor.element_size(),
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
            }
            reserved = [_request(context, shard, reserve) for shard in shards]
            for result in reserved:
                if result.get("write"):
                    rc = engine.batch_transfer_sync_write(
                        result["dst_session"],
                        [source.data_ptr()],
                        [result["dst_ptr"]],
                        [source.numel()],
                    )
                    if rc != 0:
                        raise RuntimeError(f"Mooncake write failed ({rc})")
            for shard, result in zip(shards, reserved, strict=True):
                done = {"transfer_id": transfer_id, "reservation_id": result["reservation_id"]}
                _request(context, shard, {"op": "complete_batch", "items": [done]})
            results += reserved
    finally:
        for source in sources:
            engine.unregister_memory(source.data_ptr())
        context.term()
    return results
