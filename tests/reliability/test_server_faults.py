"""Faults around the real server (Hypercorn, on asyncio and on Trio): clients that go away
during ``/encode`` (also at once, before their body was read) and ``/send``, and a
data-parallel worker killed under load.

Every call ends with an answer or a clear error within its bound, the Encoder holds nothing
afterwards, and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from collections import Counter

import anyio
import httpx
import pytest

from encdisagg import Encoder
from encdisagg.pipeline import serve_asgi
from encdisagg.server import ServerSettings, create_app
from encdisagg.transfer import ZmqReceiver

from ._support import SlowNullModel, fast_config, running_server, sized, wait_idle

pytestmark = pytest.mark.anyio


def nowhere_url() -> str:
    """A tcp URL nobody listens on: a push to it waits until the send timeout."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


async def serves_normally(client: httpx.AsyncClient, receiver: ZmqReceiver, tag: str) -> None:
    """A full encode + send round works, and /health answers 200."""
    response = await client.post("/encode", json={"req_id": tag, "mm_items": [tag]})
    assert response.status_code == 200, response.text
    response = await client.post("/send", json={"req_id": tag, "receive_url": receiver.url})
    assert response.status_code == 200, response.text
    with anyio.fail_after(5):
        assert (await receiver.receive()).header.req_id == tag
    response = await client.get("/health")
    assert response.status_code == 200, response.text


async def test_clients_leaving_during_encode_leave_nothing_behind() -> None:
    model = SlowNullModel(forward_s=0.3)
    encoder = Encoder(fast_config(max_batch_size=4, send_timeout_s=60.0), model=model)
    clients = sized(8, 64)
    async with (
        running_server(encoder) as url,
        ZmqReceiver() as receiver,
        httpx.AsyncClient(base_url=url, timeout=0.05) as impatient,
        httpx.AsyncClient(base_url=url, timeout=10.0) as client,
    ):
        outcomes: Counter[str] = Counter()

        async def leave_early(index: int) -> None:
            with anyio.fail_after(5):
                try:
                    await impatient.post(
                        "/encode", json={"req_id": f"gone-{index}", "mm_items": ["x"]}
                    )
                    outcomes["answered"] += 1
                except httpx.TimeoutException:
                    outcomes["left"] += 1

        async with anyio.create_task_group() as group:
            for index in range(clients):
                group.start_soon(leave_early, index)
        assert outcomes["left"] > 0, outcomes
        # The server noticed: each encode was cancelled (a forward already running still
        # completes, after which nothing stays staged), well before the send deadline of 10 s
        # would have released a staged request.
        await wait_idle(encoder, bound_s=clients / 4 * model.forward_s + 3.0)
        await serves_normally(client, receiver, "after-encode-disconnects")
        await wait_idle(encoder)


def close_wait_sockets(port: int) -> int:
    """This process's TCP sockets on local ``port`` in CLOSE-WAIT: connections their client
    closed that the server has not closed yet."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                # 08: CLOSE-WAIT.
                if local_port == port and fields[3] == "08" and fields[9] in inodes:
                    count += 1
    return count


async def wait_no_close_wait(port: int, bound_s: float) -> None:
    with anyio.move_on_after(bound_s):
        while close_wait_sockets(port):
            await anyio.sleep(0.02)
    assert close_wait_sockets(port) == 0, "connections the clients closed are still open"


async def test_clients_leaving_at_once_after_encode_leave_nothing_behind() -> None:
    """Each client sends its whole /encode and closes at once: the server reads the body and
    the end of the connection together. Each request is noticed and released (those whose
    forward had begun once it ends), and every connection closed, long before the send
    deadline (60 s) would have released them."""
    model = SlowNullModel(forward_s=0.2)
    encoder = Encoder(fast_config(max_batch_size=8, send_timeout_s=60.0), model=model)
    clients = 32
    async with (
        running_server(encoder) as url,
        ZmqReceiver() as receiver,
        httpx.AsyncClient(base_url=url, timeout=10.0) as client,
    ):
        address = httpx.URL(url)
        assert address.port is not None

        async def leave_at_once(index: int) -> None:
            body = json.dumps({"req_id": f"left-{index}", "mm_items": ["x"]}).encode()
            head = (
                "POST /encode HTTP/1.1\r\nHost: encdisagg\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            stream = await anyio.connect_tcp(address.host, address.port)
            await stream.send(head.encode() + body)
            await stream.aclose()

        async with anyio.create_task_group() as group:
            for index in range(clients):
                group.start_soon(leave_at_once, index)
        await wait_idle(encoder, bound_s=clients / 8 * model.forward_s + 5.0)
        await wait_no_close_wait(address.port, bound_s=5.0)
        await serves_normally(client, receiver, "after-leaving-at-once")
        await wait_idle(encoder)


async def test_clients_leaving_during_send_leave_nothing_behind() -> None:
    encoder = Encoder(fast_config(zmq_send_timeout_s=30.0), model=SlowNullModel(0.0))
    clients = sized(6, 32)
    async with (
        running_server(encoder) as url,
        ZmqReceiver() as receiver,
        httpx.AsyncClient(base_url=url, timeout=10.0) as client,
        httpx.AsyncClient(base_url=url, timeout=0.2) as impatient,
    ):
        for index in range(clients):
            response = await client.post(
                "/encode", json={"req_id": f"stuck-{index}", "mm_items": ["x"]}
            )
            assert response.status_code == 200
        assert encoder.stats().live_requests == clients
        left = 0

        async def leave_early(index: int) -> None:
            nonlocal left
            # The push waits for a peer that never comes (its bound is 30 s); the client
            # leaves after 0.2 s, which cancels the send on the server.
            with anyio.fail_after(5):
                try:
                    await impatient.post(
                        "/send", json={"req_id": f"stuck-{index}", "receive_url": nowhere_url()}
                    )
                except httpx.TimeoutException:
                    left += 1

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                for index in range(clients):
                    group.start_soon(leave_early, index)
        assert left == clients
        # A cancelled send releases its request, once ZMQ let go of the payload.
        await wait_idle(encoder, bound_s=5.0)
        response = await client.post(
            "/send", json={"req_id": "stuck-0", "receive_url": receiver.url}
        )
        assert response.status_code in (404, 409), response.text
        await serves_normally(client, receiver, "after-send-disconnects")


async def test_data_parallel_worker_killed_under_load(anyio_backend_name: str) -> None:
    config = fast_config(request_timeout_s=10.0, zmq_send_timeout_s=5.0)
    settings = ServerSettings(dp=2, worker_start_timeout_s=120.0, worker_stop_timeout_s=10.0)
    app = create_app(config, settings=settings, flavour=anyio_backend_name)  # type: ignore[arg-type]
    service = app.extensions["encdisagg"]
    requests = sized(120, 2000)
    outcomes: Counter[int] = Counter()
    async with (
        serve_asgi(app, graceful_timeout_s=2.0, shutdown_timeout_s=30.0) as url,
        ZmqReceiver(max_queued_messages=4096) as receiver,
        httpx.AsyncClient(base_url=url, timeout=30.0) as client,
    ):
        backend = service.backend
        assert backend is not None

        async def drain() -> None:
            while True:
                await receiver.receive()

        counter = iter(range(requests))
        killed = anyio.Event()

        async def worker() -> None:
            for index in counter:
                rid = f"load-{index}"
                with anyio.fail_after(20):  # each call's bound: request_timeout_s + slack
                    response = await client.post("/encode", json={"req_id": rid, "mm_items": [rid]})
                    outcomes[response.status_code] += 1
                    if response.status_code != 200:
                        continue
                    response = await client.post(
                        "/send", json={"req_id": rid, "receive_url": receiver.url}
                    )
                    outcomes[response.status_code] += 1
                if index == requests // 3:
                    killed.set()

        async def kill() -> None:
            await killed.wait()
            pid = backend.pid_of(0)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)

        async with anyio.create_task_group() as outer:
            outer.start_soon(drain)
            async with anyio.create_task_group() as group:
                group.start_soon(kill)
                for _ in range(8):
                    group.start_soon(worker)
            # Every answer is a success, or 503 for what the dead worker held; and the
            # follow-up /send of a request whose encode went to the dead worker: 503 too.
            assert set(outcomes) <= {200, 503}, outcomes
            assert outcomes[200] > requests, outcomes
            print(f"outcomes with a worker killed: {dict(outcomes)}")
            # The surviving worker keeps serving.
            for index in range(5):
                rid = f"after-{index}"
                response = await client.post("/encode", json={"req_id": rid, "mm_items": [rid]})
                assert response.status_code == 200, response.text
            outer.cancel_scope.cancel()
