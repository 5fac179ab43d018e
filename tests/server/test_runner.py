"""``serve``: real Hypercorn (asyncio and Trio), port 0, graceful shutdown, startup failure."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import anyio.to_thread
import httpx
import pytest
from quart import Quart

from encdisagg import Encoder, EncoderConfig

from ._helpers import fast_config, png_data_url
from .test_health import GatedModel

pytestmark = pytest.mark.anyio


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


async def test_serves_on_a_free_port_and_drains_on_shutdown(
    make_app: Callable[..., Quart],
) -> None:
    from encdisagg.server import serve

    model = GatedModel()
    encoder = Encoder(fast_config(), model=model)
    stop = anyio.Event()
    urls: list[str] = []
    serving = anyio.Event()

    def on_serving(url: str) -> None:
        urls.append(url)
        serving.set()

    async with anyio.create_task_group() as group:
        group.start_soon(
            lambda: serve(
                make_app(encoder),
                port=0,
                shutdown_trigger=stop.wait,
                on_serving=on_serving,
                graceful_timeout_s=10.0,
            )
        )
        with anyio.fail_after(30):
            await serving.wait()
        (url,) = urls
        assert url.startswith("http://127.0.0.1:")
        assert not url.endswith(":0")
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            model.gate.set()
            assert (await client.get("/health")).status_code == 200
            model.gate.clear()
            model.entered.clear()
            answers: list[httpx.Response] = []

            async def slow_encode() -> None:
                answers.append(
                    await client.post("/encode", json={"req_id": "slow", "mm_items": ["x"]})
                )

            async with anyio.create_task_group() as requests:
                requests.start_soon(slow_encode)
                await anyio.to_thread.run_sync(model.entered.wait, 10)
                # Shut down while the request is in flight: it still completes.
                stop.set()
                await anyio.sleep(0.2)
                model.gate.set()
    assert [response.status_code for response in answers] == [200]
    assert answers[0].json()["req_id"] == "slow"
    assert not encoder.is_open
    assert encoder.stats().live_requests == 0


async def test_startup_failure_raises(make_app: Callable[..., Quart]) -> None:
    from encdisagg.server import serve

    announced = threading.Event()
    with pytest.raises(BaseException) as caught:
        with anyio.fail_after(30):
            await serve(
                make_app(EncoderConfig(model="./no-such-model")),
                port=0,
                shutdown_trigger=anyio.Event().wait,
                on_serving=lambda url: announced.set(),
            )
    messages = " ".join(str(leaf) for leaf in _leaves(caught.value))
    assert "no-such-model" in messages
    assert not announced.is_set()


async def test_serves_a_real_image_end_to_end(make_app: Callable[..., Quart]) -> None:
    from encdisagg.server import bind_socket, serve

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    stop = anyio.Event()
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: serve(make_app(), sock=sock, shutdown_trigger=stop.wait))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            with anyio.fail_after(30):
                while True:
                    try:
                        response = await client.post(
                            "/encode",
                            json={"req_id": "img", "mm_items": [png_data_url(448, 448)]},
                        )
                        break
                    except httpx.TransportError:
                        await anyio.sleep(0.05)
            assert response.status_code == 200
            assert response.json()["grid"] == [[1, 32, 32]]
            assert (await client.post("/release", json={"req_id": "img"})).json() is None
        stop.set()
