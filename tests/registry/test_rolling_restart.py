"""A rolling restart of one of two fleet encoders (real ``encdisagg serve`` processes, a real
etcd) under a bounded load: no request fails and none is encoded twice."""

from __future__ import annotations

import functools
import urllib.request

import anyio
import anyio.to_thread
import pytest
import torch

from encdisagg import Modality
from encdisagg.models import NullVisionModel
from encdisagg.receiver import EmbeddingReceiver, EncoderClient, EncoderFleet, fetch_from_fleet

from ._etcd_server import EtcdServer, needs_etcd
from ._serve_process import ServeProcess, start_serve

pytestmark = [pytest.mark.anyio, needs_etcd]

MODEL = NullVisionModel()
#: Requests in flight at once.
CONCURRENCY = 4
#: Bound on each stage of the run.
STAGE_S = 60.0


def encodes(server: ServeProcess) -> int:
    """The encodes the server counted (its /metrics)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("encdisagg_requests_total{")
    )


class Progress:
    """Completed requests, and waits on their count (woken by each completion)."""

    def __init__(self) -> None:
        self.completed = 0
        self.failed: list[str] = []
        self.inexact: list[str] = []
        self._changed = anyio.Event()

    def note(self) -> None:
        self.completed += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_until(self, count: int) -> None:
        with anyio.fail_after(STAGE_S):
            while self.completed < count:
                await self._changed.wait()


async def test_a_rolling_restart_fails_and_re_encodes_nothing(
    etcd: EtcdServer, anyio_backend_name: str
) -> None:
    registry = etcd.registry()
    serve = functools.partial(
        start_serve, "127.0.0.1", registry, "--drain-delay=1", backend=anyio_backend_name
    )
    first = await anyio.to_thread.run_sync(serve)
    servers = [first]
    try:
        servers.append(await anyio.to_thread.run_sync(serve))
        fleet = EncoderFleet(registry, model="null")
        receiver = EmbeddingReceiver(
            transport="zmq", hidden_size=MODEL.hidden_size, dtype=MODEL.dtype
        )
        progress = Progress()
        stop = anyio.Event()
        async with EncoderClient(registry=fleet, encode_timeout_s=10.0) as client, receiver:
            with anyio.fail_after(STAGE_S):
                await fleet.wait_for(2)

            async def load(index: int) -> None:
                n = 0
                while not stop.is_set():
                    rid, item = f"w{index}-{n}", f"media-{index}-{n}"
                    n += 1
                    try:
                        # One attempt: a failover (an encode done again elsewhere) fails it.
                        async with fetch_from_fleet(
                            client, receiver, rid, {"image": [item]}, max_attempts=1
                        ) as got:
                            want = torch.cat(
                                MODEL.forward([MODEL.preprocess([item], Modality.IMAGE)])
                            )
                            if not torch.equal(got.parts[0].tensor, want):
                                progress.inexact.append(rid)
                    except Exception as exc:
                        progress.failed.append(f"{rid}: {exc!r}")
                    progress.note()

            async with anyio.create_task_group() as group:
                for index in range(CONCURRENCY):
                    group.start_soon(load, index)
                await progress.wait_until(20)
                # Restart the first encoder: drain it, then start a new one in its place.
                first.terminate()
                assert await anyio.to_thread.run_sync(first.stop) == 0
                at_restart = progress.completed
                replacement = await anyio.to_thread.run_sync(serve)
                servers.append(replacement)
                with anyio.fail_after(STAGE_S):
                    while replacement.url not in fleet.urls:
                        await anyio.sleep(0.05)
                await progress.wait_until(at_restart + 40)
                with anyio.fail_after(STAGE_S):
                    while await anyio.to_thread.run_sync(encodes, replacement) == 0:
                        await progress.wait_until(progress.completed + 1)
                stop.set()
        assert progress.failed == []
        assert progress.inexact == []
        assert progress.completed >= at_restart + 40
    finally:
        for server in servers:
            await anyio.to_thread.run_sync(server.kill_group)
