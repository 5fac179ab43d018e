"""The real-Mooncake cell of ``bench_peer.py``: both sides write each embedding into a
receiver's registered buffer with Mooncake's TCP transport on loopback, then push its metadata
to the same kind of ZMQ sink as the other cells.

- **The receiver**: one Mooncake engine holding one registered buffer, in a process of its
  own (``_transfer_peers.py mooncake``), shared by both sides. Task ``i`` of a run writes
  the ``i``-th :data:`SLOT_BYTES` slot of it, so no two writes in flight overlap.
- **SGLang's side**: ``MMEncoder`` as the peer's ``make_encoder("full")`` builds it, with its
  fake engine replaced by SGLang's own ``MooncakeTransferEngine`` (TCP, P2P handshake, on
  127.0.0.1) and a ``SendDestination`` naming the receiver's session and a slot. Per
  lifecycle, what its encode path does when the transfer backend is Mooncake: a fresh 2x4
  float16 embedding, registered when staged (``_register_shared_mr``, on the event loop),
  staged; ``send_to_destination`` (``transfer_sync`` in ``asyncio.to_thread``, then the
  metadata frame over ZMQ); ``release_request`` (which deregisters it, on the event loop).
- **Ours**: the same lifecycle as in the other cells, with a ``MooncakeEngine`` instead of
  the no-op engine (``_peer_sides.our_run``): the embedding is staged in the arena that the
  Encoder registered once, and the write is submitted and polled on the event loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Each task's slot in the receiver's buffer (an embedding is 16 bytes; a cache line apart).
SLOT_BYTES = 64


def slot_addresses(receiver: dict[str, Any], count: int) -> list[int]:
    """The receiver-buffer addresses that ``count`` tasks write, one each."""
    return [receiver["ptr"] + index * SLOT_BYTES for index in range(count)]


@contextmanager
def mooncake_receiver(slots: int) -> Iterator[dict[str, Any]]:
    """A receiver process with ``slots`` slots registered: ``{"session", "ptr"}``."""
    from _transfer_peers import start_peer, stop_peer

    process, receiver, errors = start_peer("mooncake", str(slots * SLOT_BYTES))
    try:
        yield receiver
    finally:
        stop_peer(process, errors)


def tcp_for_sglang() -> None:
    """Make SGLang's Mooncake wrapper use TCP (its default is RDMA) and Mooncake log only
    warnings; before anything of Mooncake loads."""
    os.environ["MC_FORCE_TCP"] = "1"
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


def _sglang_engine() -> Any:
    """SGLang's ``MooncakeTransferEngine`` on 127.0.0.1, counting its registrations."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    class Counted(MooncakeTransferEngine):
        def __init__(self) -> None:
            # list.append is atomic: no count is lost to a worker thread.
            self.registered: list[int] = []
            self.refused: list[int] = []
            self.deregistered: list[int] = []
            super().__init__("127.0.0.1")

        def register(self, ptr: int, length: int) -> None:
            try:
                super().register(ptr, length)
            except Exception:
                self.refused.append(ptr)
                raise
            self.registered.append(ptr)

        def deregister(self, ptr: int) -> None:
            super().deregister(ptr)
            self.deregistered.append(ptr)

    return Counted()


async def peer_run(
    bench: Any,
    concurrency: int,
    total: int,
    receiver: dict[str, Any],
    *,
    shape: tuple[int, int],
    sink_wait_s: float,
) -> dict[str, Any]:
    """``total`` of SGLang's lifecycles of ``shape`` embeddings in ``concurrency`` asyncio
    tasks over the real engine (``bench`` is the peer's ``bench.py``); then the leak checks,
    waiting up to ``sink_wait_s`` for the sink. Needs ``get_disagg`` patched to say Mooncake,
    as ``run_once`` does."""
    import asyncio

    import torch
    from sglang.srt.disaggregation.encoder.receiver import EmbeddingData
    from sglang.srt.managers.schedule_batch import Modality

    encoder = bench.make_encoder("full")
    engine = encoder.engine = _sglang_engine()
    port, stop, thread, received = bench.start_sink(encoder.sync_context)
    targets = [
        bench.srv.SendDestination(
            f"127.0.0.1:{port}", session_id=receiver["session"], buffer_address=address
        )
        for address in slot_addresses(receiver, concurrency)
    ]
    per_worker = total // concurrency
    latencies: list[float] = []

    async def lifecycle(rid: str, target: Any) -> None:
        embedding = torch.ones(shape, dtype=torch.float16)  # what an encode returns, fresh
        state = encoder._acquire_encode_ref(rid)
        data = EmbeddingData(rid, 1, 0, None, Modality.IMAGE, embedding=embedding)
        encoder._register_shared_mr(data, embedding)
        encoder._stage_embedding(data)
        await encoder._release_encode_ref(state)
        await encoder.send_to_destination(state, target)
        await encoder.release_request(rid)

    async def worker(index: int) -> None:
        for i in range(per_worker):
            start = time.perf_counter()
            await lifecycle(f"r{index}-{i}", targets[index])
            latencies.append(time.perf_counter() - start)

    try:
        await lifecycle("warmup", targets[0])
        start = time.perf_counter()
        await asyncio.gather(*(worker(index) for index in range(concurrency)))
        elapsed = time.perf_counter() - start
        n = per_worker * concurrency
        if encoder.req_states:
            raise AssertionError(f"leaked request state: {len(encoder.req_states)} requests")
        counts = len(engine.registered), len(engine.deregistered), len(engine.refused)
        if counts != (n + 1, n + 1, 0):
            raise AssertionError(
                f"registered, deregistered, refused: {counts}; wanted {n + 1}, {n + 1}, 0"
            )
        deadline = time.monotonic() + sink_wait_s
        while received[0] < n + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if received[0] != n + 1:
            raise AssertionError(f"the sink received {received[0]} pushes of {n + 1}")
    finally:
        stop.set()
        thread.join()
        encoder.executor.shutdown()
        encoder.sync_context.term()
        # The last reference: the Mooncake engine is destroyed here, not at some later run.
        encoder.engine = engine = None
    return {"rate": n / elapsed, "n": n, "latencies_s": latencies}
