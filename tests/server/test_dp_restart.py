"""``encdisagg serve --dp 2``: a worker killed with SIGKILL is started again and serves, its
requests fail with 503, and readiness follows the workers that serve."""

from __future__ import annotations

import os
import re
import signal

import anyio
import anyio.to_thread
import httpx
import pytest
import torch

from encdisagg.server._dp._restarts import RestartPolicy
from encdisagg.transfer import ZmqReceiver

from ._serve_cli import encode, expected, start, wait_status

pytestmark = pytest.mark.anyio

_READY = re.compile(r"data-parallel worker (\d) \(pid (\d+)\) is ready")


def test_restarts_back_off_and_give_up_after_the_limit_in_the_window() -> None:
    policy = RestartPolicy(limit=3, window_s=60.0, first_delay_s=0.5, max_delay_s=1.5)
    assert [policy.on_death(0, now) for now in (0.0, 1.0, 2.0)] == [0.5, 1.0, 1.5]
    assert policy.on_death(0, 3.0) is None
    assert policy.on_death(1, 3.0) == 0.5  # ranks are counted apart
    # Once the first restart left the window, one more is allowed.
    assert policy.on_death(0, 60.5) == 1.5
    assert RestartPolicy(limit=0, window_s=60.0).on_death(0, 0.0) is None


async def test_a_killed_worker_is_started_again_and_serves(anyio_backend_name: str) -> None:
    server = await start(
        "--dp=2", "--ready-min-workers=2", "--drain-delay=0", worker_class=anyio_backend_name
    )
    try:
        pids = {int(m[1]): int(m[2]) for m in _READY.finditer(server.output)}
        assert sorted(pids) == [0, 1]
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as http,
            ZmqReceiver() as receiver,
        ):
            assert (await http.get("/health/ready")).status_code == 200
            # Idle workers take encodes in turn: "a" goes to worker 0, "b" to worker 1.
            assert (await encode(http, "a")).status_code == 200
            assert (await encode(http, "b")).status_code == 200
            os.kill(pids[0], signal.SIGKILL)
            down = await wait_status(http, "/health/ready", 503)
            assert "worker 0 down" in down.json()["message"]
            assert (await http.get("/health/live")).status_code == 200
            # What the dead worker held is gone: a clear 503, before and after its restart.
            lost = await http.post("/send", json={"req_id": "a", "receive_url": receiver.url})
            assert lost.status_code == 503
            assert "worker 0" in lost.json()["message"]
            await wait_status(http, "/health/ready", 200)
            lost = await http.post("/send", json={"req_id": "a", "receive_url": receiver.url})
            assert lost.status_code == 503
            restarted = await anyio.to_thread.run_sync(
                server.wait_line,
                lambda line: (
                    (m := _READY.search(line)) is not None
                    and int(m[1]) == 0
                    and int(m[2]) != pids[0]
                ),
            )
            assert "starting data-parallel worker 0 again (restart 1)" in server.output
            assert restarted
            metrics = (await http.get("/metrics")).text
            assert 'encdisagg_dp_worker_restarts_total{rank="0"} 1.0' in metrics
            assert 'encdisagg_dp_worker_restarts_total{rank="1"} 0.0' in metrics
            # Both workers serve, the survivor's request included.
            sent = ["b"]
            for index in range(4):
                assert (await encode(http, f"after-{index}")).status_code == 200
                sent.append(f"after-{index}")
            for req_id in sent:
                answer = await http.post(
                    "/send", json={"req_id": req_id, "receive_url": receiver.url}
                )
                assert answer.status_code == 200, answer.text
                with anyio.fail_after(10):
                    part = await receiver.receive()
                assert part.header.req_id == req_id
                assert part.tensor is not None
                assert torch.equal(part.tensor, expected(f"item-{req_id}"))
            metrics = (await http.get("/metrics")).text
            assert 'encdisagg_dp_worker_up{rank="0"} 1.0' in metrics
            assert 'encdisagg_requests_total{modality="image",status="ok"}' in metrics
        server.signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(server.wait_exit) == 0
    finally:
        await anyio.to_thread.run_sync(server.kill)
