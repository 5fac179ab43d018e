"""``/health/live`` and ``/health/ready``: liveness, and readiness that turns false when a
drain begins, while the model is not loaded, and while a data-parallel worker is down."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import anyio
import pytest
from quart import Quart

from encdisagg.server import DataParallelBackend

from ._helpers import fast_config, running

pytestmark = pytest.mark.anyio


async def _ready(client: object) -> tuple[int, str | None]:
    response = await client.get("/health/ready")  # type: ignore[attr-defined]
    body = await response.get_json()
    return response.status_code, body.get("message")


async def test_ready_and_live_then_readiness_falls_when_a_drain_begins(
    make_app: Callable[..., Quart],
) -> None:
    app = make_app(fast_config(model="null"))
    service = app.extensions["encdisagg"]
    async with running(app) as client:
        assert await _ready(client) == (200, None)
        live = await client.get("/health/live")
        assert (live.status_code, await live.get_json()) == (200, {"status": "ok"})

        service.start_draining()
        status, message = await _ready(client)
        assert status == 503
        assert message == "not ready: the server is draining"
        assert (await client.get("/health/live")).status_code == 200, "still alive"
        assert (await client.get("/health")).status_code == 200, "/health is as it was"
        response = await client.post("/encode", json={"req_id": "r", "mm_items": ["x"]})
        assert response.status_code == 200, "a drain still serves what reaches it"
    # The lifespan closed the service: still draining, never ready again.
    assert await _ready(client) == (503, "not ready: the server is draining")


async def test_not_ready_while_the_model_is_not_loaded(make_app: Callable[..., Quart]) -> None:
    app = make_app(fast_config(model="null"))
    client = app.test_client()  # no lifespan: the service never opened
    response = await client.get("/health/ready")
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert (await response.get_json()) == {
        "status": "error",
        "message": "not ready: the model is not loaded",
        "req_id": None,
    }
    assert (await client.get("/health/live")).status_code == 200


async def test_probes_need_no_api_key_and_are_counted(make_app: Callable[..., Quart]) -> None:
    app = make_app(fast_config(model="null"), api_key="secret-key")
    async with running(app) as client:
        assert (await client.get("/health/live")).status_code == 200
        assert (await client.get("/health/ready")).status_code == 200
        assert (await client.post("/release", json={"req_id": "r"})).status_code == 401
        text = await (await client.get("/metrics")).get_data(as_text=True)
    assert 'route="/health/ready"' in text
    assert 'route="/health/live"' in text


async def test_not_ready_while_a_data_parallel_worker_is_down(
    make_app: Callable[..., Quart],
) -> None:
    config = fast_config(model="null")
    app = make_app(
        config,
        dp=2,
        worker_start_timeout_s=120,
        worker_stop_timeout_s=10,
        ready_min_workers=2,
        worker_restart_limit=0,
    )
    service = app.extensions["encdisagg"]
    async with running(app) as client:
        backend = service.backend
        assert isinstance(backend, DataParallelBackend)
        assert await _ready(client) == (200, None)
        pid = backend.pid_of(1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        # The front's watcher sees the exit; wait for that event, not for time.
        with anyio.fail_after(30):
            await backend._workers[1].exited.wait()
        assert await _ready(client) == (
            503,
            "not ready: data-parallel worker 1 down (1 of 2 serve; 2 needed)",
        )
        assert (await client.get("/health/live")).status_code == 200
