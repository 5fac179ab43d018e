"""Data parallel with real worker processes (``--dp 2``): spread, direct transfers, a
cancelled call releasing the worker's state, and a worker killed mid-request.

The workers run the real worker module with the ``null`` model (no compute), so the
processes, ZMQ channels and Encoders are real and the test stays fast. One app start per
backend carries all checks: starting workers dominates the cost.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable

import anyio
import pytest
import torch
from quart import Quart
from quart.typing import TestClientProtocol as Client

from encdisagg import ZmqDestination
from encdisagg.server import DataParallelBackend, SendBody

from ._helpers import fast_config, png_data_url, running

pytestmark = pytest.mark.anyio


def closed_port_url() -> str:
    """A tcp URL nobody listens on: a push to it hangs until the send timeout."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


async def live_requests(client: Client) -> float:
    text = (await (await client.get("/metrics")).get_data()).decode()
    for line in text.splitlines():
        if line.startswith("encdisagg_live_requests "):
            return float(line.split()[1])
    raise AssertionError("no encdisagg_live_requests in /metrics")


async def wait_idle(client: Client) -> None:
    with anyio.fail_after(10):
        while await live_requests(client) != 0:
            await anyio.sleep(0.05)


async def encode(client: Client, req_id: str) -> int:
    response = await client.post("/encode", json={"req_id": req_id, "mm_items": [req_id]})
    assert response.status_code == 200, await response.get_data()
    return (await response.get_json())["embedding_len"]


async def test_two_workers(make_app: Callable[..., Quart]) -> None:
    config = fast_config(model="null", request_timeout_s=30, zmq_send_timeout_s=30)
    # Not started again: this test shows what a dead worker leaves (test_dp_restart: more).
    app = make_app(
        config, dp=2, worker_start_timeout_s=120, worker_stop_timeout_s=10, worker_restart_limit=0
    )
    service = app.extensions["encdisagg"]
    nowhere = closed_port_url()
    async with running(app) as client:
        backend = service.backend
        assert isinstance(backend, DataParallelBackend)
        assert (await client.get("/health")).status_code == 200

        # Concurrent encodes spread over both workers.
        ids = [f"spread-{index}" for index in range(6)]
        async with anyio.create_task_group() as group:
            for req_id in ids:
                group.start_soon(encode, client, req_id)
        assert sorted(backend.rank_of(req_id) for req_id in ids) == [0, 0, 0, 1, 1, 1]
        text = (await (await client.get("/metrics")).get_data()).decode()
        assert 'encdisagg_requests_total{modality="image",status="ok"} 6.0' in text
        assert 'encdisagg_dp_worker_up{rank="1"} 1.0' in text

        # A worker's transfer goes straight to the receiver.
        from encdisagg.transfer import ZmqReceiver

        async with ZmqReceiver() as receiver:
            response = await client.post(
                "/send", json={"req_id": "spread-0", "receive_url": receiver.url}
            )
            assert response.status_code == 200
            with anyio.fail_after(10):
                part = await receiver.receive()
        assert part.header.req_id == "spread-0"
        assert part.tensor is not None
        assert tuple(part.tensor.shape) == (16, 64)
        assert torch.all(part.tensor == part.tensor[0, 0])
        for req_id in ids[1:]:
            assert (await client.post("/release", json={"req_id": req_id})).status_code == 200
        await wait_idle(client)

        # A call whose caller leaves makes its worker release the request.
        await encode(client, "left")
        with anyio.move_on_after(0.5) as scope:
            await backend.send(SendBody("left", ZmqDestination(nowhere)))
        assert scope.cancelled_caught
        await wait_idle(client)

        # Kill a worker while it holds a request mid-send.
        await encode(client, "victim")
        victim = backend.rank_of("victim")
        assert victim is not None
        index = 0
        while True:
            await encode(client, f"other-{index}")
            if backend.rank_of(f"other-{index}") != victim:
                break
            index += 1
        other = f"other-{index}"
        answers: dict[str, int] = {}

        async def stuck_send() -> None:
            response = await client.post("/send", json={"req_id": "victim", "receive_url": nowhere})
            answers["victim"] = response.status_code

        async with anyio.create_task_group() as group:
            group.start_soon(stuck_send)
            with anyio.fail_after(10):
                while backend.workers[victim].pending == 0:
                    await anyio.sleep(0.02)
            await anyio.sleep(0.2)
            pid = backend.pid_of(victim)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        assert answers == {"victim": 503}

        response = await client.get("/health")
        assert response.status_code == 503
        assert "down" in (await response.get_json())["message"]
        response = await client.post(
            "/scheduler_receive_meta_data", json={"req_id": "victim", "part_idx": 0}
        )
        assert response.status_code == 503
        response = await client.post(
            "/scheduler_receive_meta_data", json={"req_id": other, "part_idx": 0}
        )
        assert response.status_code == 200
        for index in range(3):
            assert await encode(client, f"after-{index}") == 16
        async with ZmqReceiver() as receiver:
            response = await client.post(
                "/send", json={"req_id": other, "receive_url": receiver.url}
            )
            assert response.status_code == 200
            with anyio.fail_after(10):
                assert (await receiver.receive()).header.req_id == other
        text = (await (await client.get("/metrics")).get_data()).decode()
        assert f'encdisagg_dp_worker_up{{rank="{victim}"}} 0.0' in text
    assert all(not worker.alive for worker in backend.workers)


async def test_a_call_a_worker_refuses_answers_its_error_and_the_worker_lives_on(
    make_app: Callable[..., Quart],
) -> None:
    app = make_app(fast_config(request_timeout_s=30), dp=2, worker_start_timeout_s=120)
    service = app.extensions["encdisagg"]
    async with running(app) as client:
        backend = service.backend
        assert isinstance(backend, DataParallelBackend)
        pids = {rank: backend.pid_of(rank) for rank in (0, 1)}
        # Twice, so each worker refuses one: an undecodable image is the worker's 400.
        for index in range(2):
            response = await client.post(
                "/encode",
                json={"req_id": f"bad-{index}", "mm_items": ["data:image/png;base64,QUJDRA=="]},
            )
            assert response.status_code == 400, await response.get_data()
            assert "mm_items[0]" in (await response.get_json())["message"]
        for index in range(2):
            body = {"req_id": f"good-{index}", "mm_items": [png_data_url(56, 56, seed=index)]}
            assert (await client.post("/encode", json=body)).status_code == 200
        assert {rank: backend.pid_of(rank) for rank in (0, 1)} == pids
