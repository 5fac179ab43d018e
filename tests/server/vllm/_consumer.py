"""A stand-in for vLLM's Mooncake EC consumer: real ZMQ REP sockets, real registered buffers.

Each TP shard is a REP socket served by a thread, with a receive buffer registered with a
Mooncake engine of its own; shard 0's address is the ``consumer_zmq`` the proxy names, and
answers ``peers`` with every shard's port. Written from the wire as observed (one-frame JSON,
``{"ok", "result"|"error"}``), as our own fixture. Each shard records the requests it got, and
answers ``reserve`` as its ``mode`` says:

- ``"write"``: a reservation to write into (the default);
- ``"no-write"``: ``write: false`` (another producer writes the same item);
- ``"cached"``: the bytes are there already;
- ``"cancelled"``: the PD gave the transfer up;
- ``"full"``: ``ok: false`` with the pool-full error;
- ``"complete-fails"``: a reservation, but ``complete_batch`` answers ``completed: false``.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from encdisagg.transfer import MooncakeEngine

#: Bytes of each shard's receive buffer.
BUFFER_BYTES = 1 << 20


@dataclass(eq=False)
class FakeShard:
    engine: MooncakeEngine
    socket: zmq.Socket[Any]
    port: int
    mode: str = "write"
    buffer: torch.Tensor = field(
        default_factory=lambda: torch.zeros(BUFFER_BYTES, dtype=torch.uint8)
    )
    requests: list[dict[str, Any]] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    @property
    def ops(self) -> list[str]:
        return [str(request.get("op")) for request in self.requests]

    def landed(self, nbytes: int) -> bytes:
        return self.buffer[:nbytes].numpy().tobytes()

    def answer(self, request: dict[str, Any], ports: list[int]) -> dict[str, Any]:
        op = request.get("op")
        if op == "peers":
            return {"ok": True, "result": {"ports": ports}}
        if op == "reserve_batch":
            return {"ok": True, "result": {"items": [self._reserve(i) for i in request["items"]]}}
        if op == "complete_batch":
            completed = self.mode != "complete-fails"
            items = [{"completed": completed, "became_ready": completed} for _ in request["items"]]
            return {"ok": True, "result": {"items": items}}
        if op == "cancel":
            return {"ok": True, "result": {"cancelled": True}}
        return {"ok": False, "error": f"unknown control op: {op!r}"}

    def _reserve(self, item: dict[str, Any]) -> dict[str, Any]:
        if self.mode == "full":
            return {"ok": False, "error": "EC consumer buffer pool is full"}
        if self.mode == "cancelled":
            result: dict[str, Any] = {
                "reservation_id": "",
                "dst_session": "",
                "dst_ptr": 0,
                "nbytes": item["nbytes"],
                "write": False,
                "ready": False,
                "cancelled": True,
            }
            return {"ok": True, "result": result}
        result = {
            "reservation_id": f"res-{self.port}-{next(self._ids)}",
            "dst_session": self.engine.session_id,
            "dst_ptr": self.buffer.data_ptr(),
            "nbytes": item["nbytes"],
            "write": self.mode in ("write", "complete-fails"),
            "ready": self.mode == "cached",
            "cached": self.mode == "cached",
        }
        return {"ok": True, "result": result}


class FakeConsumer:
    """Shards on loopback, each served by its own thread until :meth:`close`."""

    def __init__(self, engines: list[MooncakeEngine], modes: list[str]) -> None:
        self._context: zmq.Context[Any] = zmq.Context()
        self._stop = threading.Event()
        self.shards: list[FakeShard] = []
        for engine, mode in zip(engines, modes, strict=True):
            sock = self._context.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            shard = FakeShard(engine, sock, port, mode)
            engine.register(shard.buffer.data_ptr(), BUFFER_BYTES)
            self.shards.append(shard)
        self.address = f"tcp://127.0.0.1:{self.shards[0].port}"
        self._threads = [
            threading.Thread(target=self._serve, args=(shard,), daemon=True)
            for shard in self.shards
        ]
        for thread in self._threads:
            thread.start()

    def _serve(self, shard: FakeShard) -> None:
        ports = [each.port for each in self.shards]
        poller = zmq.Poller()
        poller.register(shard.socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):  # wakes to see the stop flag; the test never waits on it
                continue
            request = json.loads(shard.socket.recv())
            shard.requests.append(request)
            shard.socket.send(json.dumps(shard.answer(request, ports)).encode())

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for shard in self.shards:
            shard.engine.deregister(shard.buffer.data_ptr())
            shard.socket.close(linger=0)
        self._context.term()


@contextmanager
def fake_consumer(engines: list[MooncakeEngine], *modes: str) -> Iterator[FakeConsumer]:
    with ExitStack() as stack:
        consumer = FakeConsumer(engines[: len(modes)], list(modes))
        stack.callback(consumer.close)
        yield consumer
