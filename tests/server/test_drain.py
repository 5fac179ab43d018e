"""``encdisagg serve``'s drain with real processes and real HTTP, on asyncio and Trio, with
one process and with ``--dp 2``: requests admitted before SIGTERM are delivered byte-exact
by ``/send`` calls made after it; a second signal stops at once and says what it dropped."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import anyio.to_thread
import httpx
import pytest
import torch

from encdisagg.transfer import ZmqReceiver

from ._serve_cli import encode, expected, gauge, start, wait_status
from .test_dp_workers import closed_port_url

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("dp", [1, 2])
async def test_requests_admitted_before_sigterm_are_sent_after_it(
    anyio_backend_name: str, dp: int
) -> None:
    server = await start(
        f"--dp={dp}", "--drain-delay=0.5", "--drain-timeout=30", worker_class=anyio_backend_name
    )
    try:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as http,
            ZmqReceiver() as receiver,
        ):
            admitted = [f"r{index}" for index in range(4)]
            for req_id in admitted:
                assert (await encode(http, req_id)).status_code == 200
            server.signal(signal.SIGTERM)
            # Readiness turns false at once; the listener stays open for the admitted ones.
            refused = await wait_status(http, "/health/ready", 503)
            assert refused.json()["message"] == "not ready: the server is draining"
            assert refused.headers["Retry-After"] == "1"
            assert (await http.get("/health/live")).status_code == 200
            # Encodes are admitted during the delay, then refused with 503 and Retry-After.
            index = 0
            while True:
                answer = await encode(http, f"late-{index}")
                if answer.status_code == 503:
                    break
                assert answer.status_code == 200
                admitted.append(f"late-{index}")
                index += 1
            assert answer.headers["Retry-After"] == "1"
            assert "draining" in answer.json()["message"]
            # Every admitted request is still delivered, after the signal.
            for req_id in admitted:
                sent = await http.post(
                    "/send", json={"req_id": req_id, "receive_url": receiver.url}
                )
                assert sent.status_code == 200, sent.text
                with anyio.fail_after(10):
                    part = await receiver.receive()
                assert part.header.req_id == req_id
                assert part.tensor is not None
                assert torch.equal(part.tensor, expected(f"item-{req_id}"))
        assert await anyio.to_thread.run_sync(server.wait_exit) == 0
        assert "drained: every admitted request was delivered" in server.output
    finally:
        await anyio.to_thread.run_sync(server.kill)


@pytest.mark.parametrize("dp", [1, 2])
async def test_a_second_signal_stops_at_once_and_says_what_it_dropped(
    anyio_backend_name: str, dp: int, tmp_path: Path
) -> None:
    # The push to nobody stays in flight until the second signal: the refused endpoint's
    # grace is as long as the send timeout.
    config = tmp_path / "serve.toml"
    config.write_text("[encoder]\nzmq_refused_grace_s = 600.0\n")
    server = await start(
        f"--dp={dp}",
        f"--config={config}",
        "--drain-delay=0",
        "--drain-timeout=60",
        worker_class=anyio_backend_name,
    )
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
            assert (await encode(http, "held")).status_code == 200
            assert (await encode(http, "sending")).status_code == 200
            answers: list[object] = []

            async def send_nowhere() -> None:
                # Nobody listens there: the push stays in flight for zmq_send_timeout_s.
                try:
                    reply = await http.post(
                        "/send", json={"req_id": "sending", "receive_url": closed_port_url()}
                    )
                    answers.append(reply.status_code)
                except httpx.TransportError as exc:
                    answers.append(type(exc).__name__)

            async with anyio.create_task_group() as group:
                group.start_soon(send_nowhere)
                with anyio.fail_after(30):
                    while await gauge(http, "encdisagg_inflight_transfers") == 0:
                        await anyio.sleep(0.02)
                server.signal(signal.SIGTERM)
                await wait_status(http, "/health/ready", 503)
                server.signal(signal.SIGTERM)
        status = await anyio.to_thread.run_sync(server.wait_exit)
        assert status == 128 + signal.SIGTERM, server.output[-3000:]
        assert answers
        assert answers != [200]
        output = server.output
        assert "got SIGTERM again: stopping now; dropped 2 admitted request(s)" in output
        assert "POST /send 444" in output
        assert "dropped by the server" in output
        assert "POST /send 499" not in output
    finally:
        await anyio.to_thread.run_sync(server.kill)
