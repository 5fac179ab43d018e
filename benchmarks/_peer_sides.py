"""The two sides of ``bench_peer.py``, each served in a long-lived child process.

``serve_peer`` runs in SGLang's venv, ``serve_ours`` in this project's; each answers one JSON
line on stdout per run command on stdin (``serve``). What a lifecycle does on each side is
described in ``bench_peer.py``; the real-Mooncake variant of both is in ``_peer_mooncake.py``.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Only the standard library at the top: SGLang's venv imports this file too.
from _common import serve_json_lines as serve
from _peer_mooncake import peer_run, slot_addresses, tcp_for_sglang

TOKENS = 2
HIDDEN = 4
ITEMS = (b"image",)
SINK_WAIT_S = 5.0


def _has_mooncake() -> bool:
    return importlib.util.find_spec("mooncake") is not None


def serve_peer(peer_dir: Path) -> int:
    """SGLang's side: ``run_once("full", c, n)`` of the peer's ``bench.py``, or with a
    ``receiver`` in the command, the real-Mooncake lifecycle of ``_peer_mooncake.py``."""
    import asyncio
    from types import SimpleNamespace
    from unittest.mock import patch

    tcp_for_sglang()
    spec = importlib.util.spec_from_file_location("sglang_peer_bench", peer_dir / "bench.py")
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import sglang
    import torch

    untimed = bench.one_lifecycle
    latencies: list[float] = []

    async def timed_lifecycle(enc: Any, rid: str, dest: Any, emb: Any) -> None:
        start = time.perf_counter()
        await untimed(enc, rid, dest, emb)
        if rid != "warmup":
            latencies.append(time.perf_counter() - start)

    # run_once looks the name up at call time, so every lifecycle it runs goes through here.
    bench.one_lifecycle = timed_lifecycle
    # What the peer's own command line does around run_once: the Mooncake backend.
    backend = SimpleNamespace(encoder_transfer_backend="mooncake")

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        concurrency, total = command["concurrency"], command["total"]
        with patch.object(bench.srv, "get_disagg", return_value=backend):
            if command.get("receiver") is not None:
                run = peer_run(
                    bench,
                    concurrency,
                    total,
                    command["receiver"],
                    shape=(TOKENS, HIDDEN),
                    sink_wait_s=SINK_WAIT_S,
                )
                return asyncio.run(run)
            latencies.clear()
            rate, n = asyncio.run(bench.run_once("full", concurrency, total))
        if len(latencies) != n:
            raise AssertionError(f"timed {len(latencies)} lifecycles, run_once counted {n}")
        return {"rate": rate, "n": n, "latencies_s": list(latencies)}

    hello = {
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "mooncake": _has_mooncake(),
    }
    return serve(handle, hello)


class NoopEngine:
    """A transfer engine whose calls return at once; it only counts registrations.

    ``blocking = False`` tells the Encoder its calls may run inline on the event loop.
    """

    blocking = False

    def __init__(self) -> None:
        # list.append is atomic, so worker-thread calls cannot lose a count.
        self._registered: list[int] = []
        self._deregistered: list[int] = []

    @property
    def session_id(self) -> str:
        return "127.0.0.1:1"

    def register(self, ptr: int, nbytes: int) -> None:
        self._registered.append(ptr)

    def deregister(self, ptr: int) -> None:
        self._deregistered.append(ptr)

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        return None

    def registered_regions(self) -> int:
        """As ``MooncakeEngine.registered_regions``: how many are registered now."""
        return len(self._registered) - len(self._deregistered)


class NoopBlockingEngine(NoopEngine):
    """The same no-op engine, declaring that its calls block (worker-thread calls)."""

    blocking = True


class ZmqSink:
    """A PULL socket on 127.0.0.1 that a thread drains, counting multipart messages."""

    def __enter__(self) -> ZmqSink:
        import zmq

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self.port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.received = 0  # written by the drain thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="zmq sink", daemon=True)
        self._thread.start()
        return self

    def _drain(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(50):
                self._socket.recv_multipart()
                self.received += 1
        self._socket.close(linger=0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._context.term()


async def our_run(
    concurrency: int, total: int, blocking: bool, receiver: dict[str, Any] | None
) -> dict[str, Any]:
    """``total`` of our lifecycles in ``concurrency`` tasks, over a no-op engine (blocking or
    not), or with a ``receiver`` (``{"session", "ptr"}``) over a real ``MooncakeEngine``
    writing into its registered buffer; then the leak checks."""
    from contextlib import AsyncExitStack

    import anyio
    import torch

    from encdisagg import (
        Encoder,
        EncoderConfig,
        EncodeRequest,
        MooncakeDestination,
        ZmqDestination,
    )
    from encdisagg.models import NullVisionModel
    from encdisagg.transfer import MooncakeEngine

    model = NullVisionModel(hidden_size=HIDDEN, tokens_per_item=TOKENS, dtype=torch.float16)
    config = EncoderConfig(
        transfer="mooncake",
        default_receive_count=2,
        max_queued_jobs=max(1024, 2 * concurrency),
    )
    per_worker = total // concurrency
    latencies: list[float] = []
    with ZmqSink() as sink:
        endpoint = f"127.0.0.1:{sink.port}"
        pull = ZmqDestination(f"tcp://{endpoint}")
        async with AsyncExitStack() as stack:
            engine: NoopEngine | MooncakeEngine
            if receiver is None:
                engine = NoopBlockingEngine() if blocking else NoopEngine()
                targets = [MooncakeDestination("session", 1, endpoint)] * concurrency
            else:
                engine = await stack.enter_async_context(MooncakeEngine())
                targets = [
                    MooncakeDestination(receiver["session"], address, endpoint)
                    for address in slot_addresses(receiver, concurrency)
                ]
            async with Encoder(config, model=model, engine=engine) as encoder:

                async def lifecycle(rid: str, mooncake: MooncakeDestination) -> None:
                    await encoder.encode(EncodeRequest(rid, ITEMS))
                    await encoder.send(rid, mooncake)
                    await encoder.send(rid, pull)  # the second destination releases it
                    await encoder.release(rid)

                async def worker(index: int) -> None:
                    for i in range(per_worker):
                        start = time.perf_counter()
                        await lifecycle(f"r{index}-{i}", targets[index])
                        latencies.append(time.perf_counter() - start)

                await lifecycle("warmup", targets[0])
                start = time.perf_counter()
                async with anyio.create_task_group() as group:
                    for index in range(concurrency):
                        group.start_soon(worker, index)
                elapsed = time.perf_counter() - start
                stats = encoder.stats()
                held = engine.registered_regions()
                if (stats.live_requests, stats.staged_bytes, stats.inflight_transfers) != (0, 0, 0):
                    raise AssertionError(f"leaked request state: {stats}")
                if stats.registered_regions != held:
                    raise AssertionError(f"stats() counts {stats} but the engine holds {held}")
            # Checked while a Mooncake engine is still open: closing it would undo the rest.
            if engine.registered_regions() != 0:
                raise AssertionError(f"{engine.registered_regions()} registrations never undone")
        n = per_worker * concurrency
        with anyio.move_on_after(SINK_WAIT_S):
            while sink.received < n + 1:
                await anyio.sleep(0.01)
        if sink.received != n + 1:
            raise AssertionError(f"the sink received {sink.received} pushes of {n + 1}")
    return {"rate": n / elapsed, "n": n, "latencies_s": latencies}


def serve_ours() -> int:
    """Our side: ``our_run`` on the backend each command names."""
    import anyio

    import encdisagg

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        return anyio.run(
            our_run,
            command["concurrency"],
            command["total"],
            command["blocking"],
            command.get("receiver"),
            backend=command["backend"],
        )

    hello = {
        "encdisagg": encdisagg.__version__,
        "python": sys.version.split()[0],
        "mooncake": _has_mooncake(),
    }
    return serve(handle, hello)
