"""``encdisagg serve --registry``: a real server process registers, refreshes its load, and
on SIGTERM removes its key before it finishes the work in flight."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import anyio
import anyio.to_thread
import httpx
import pytest

from encdisagg.registry import RegistryWatcher

from ._etcd_server import EtcdServer, free_port, needs_etcd
from ._serve_process import start_serve
from ._waits import WAIT_S, wait_for

pytestmark = [pytest.mark.anyio, needs_etcd]


async def inflight_transfers(http: httpx.AsyncClient) -> int:
    """The server's own count of deliveries in progress (its /metrics)."""
    text = (await http.get("/metrics")).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("encdisagg_inflight_transfers ")
    )


async def test_serve_registers_refreshes_its_load_and_withdraws_before_draining(
    etcd: EtcdServer, anyio_backend_name: str
) -> None:
    registry = etcd.registry()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "serve.toml"
        # A push to an endpoint nobody listens on stays in flight for zmq_send_timeout_s.
        config.write_text("[encoder]\nzmq_send_timeout_s = 3.0\nshutdown_grace_s = 10.0\n")
        async with RegistryWatcher(registry) as watcher:
            await watcher.wait_synced()
            view = watcher.view
            server = await anyio.to_thread.run_sync(
                functools.partial(
                    start_serve,
                    "127.0.0.1",
                    registry,
                    f"--config={config}",
                    backend=anyio_backend_name,
                )
            )
            try:
                url = server.url
                await wait_for(view, lambda: url in view, "the registration")
                record = view.get(url)
                assert record is not None
                assert (record.model, record.capacity, record.transfers) == ("null", 8, ("zmq",))
                assert record.load.queue_depth == 0
                async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
                    encoded = await http.post(
                        "/encode",
                        json={"req_id": "held", "mm_items": ["x"], "modality": "image"},
                    )
                    assert encoded.status_code == 200
                    answers: list[int] = []

                    async def send() -> None:
                        target = f"tcp://127.0.0.1:{free_port()}"
                        reply = await http.post(
                            "/send", json={"req_id": "held", "receive_url": target}
                        )
                        answers.append(reply.status_code)

                    # The load refresh shows the staged request.
                    await wait_for(
                        view,
                        lambda: (r := view.get(url)) is not None and r.load.staged_bytes > 0,
                        "the load refresh",
                    )
                    async with anyio.create_task_group() as group:
                        group.start_soon(send)
                        # Its push waits for a receiver that never comes: in flight.
                        with anyio.fail_after(WAIT_S):
                            while await inflight_transfers(http) == 0:
                                pass
                        server.terminate()
                        await wait_for(view, lambda: url not in view, "the withdrawal")
                        # The key went first (saying it drains): the send is still in flight.
                        assert url in view.drained
                        assert answers == []
                    # Then the drain let it finish (its push timed out: an error answer).
                    assert len(answers) == 1
                status = await anyio.to_thread.run_sync(server.stop)
                assert status == 0
            finally:
                await anyio.to_thread.run_sync(server.kill_group)
