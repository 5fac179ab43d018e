"""``/health``: a real probe encode; skipped while encodes make progress; 503 when down."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import anyio
import anyio.to_thread
import pytest
import torch
from quart import Quart

from encdisagg import Encoder, Modality
from encdisagg.models import NullVisionModel, Preprocessed

from ._helpers import fast_config, png_data_url, running

pytestmark = pytest.mark.anyio


class GatedModel:
    """NullVisionModel whose forward waits for ``gate`` (a unit-test fake)."""

    def __init__(self, *, fail: bool = False) -> None:
        self._inner = NullVisionModel()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = fail
        self.forwards = 0

    @property
    def hidden_size(self) -> int:
        return self._inner.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self._inner.dtype

    def preprocess(self, items: Sequence[object], modality: Modality) -> Preprocessed:
        return self._inner.preprocess(items, modality)

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        self.forwards += 1
        self.entered.set()
        if self.fail:
            raise RuntimeError("the accelerator fell off the bus")
        self.gate.wait(10)
        return self._inner.forward(batch)


async def test_probe_runs_and_is_released(make_app: Callable[..., Quart]) -> None:
    encoder = Encoder(fast_config())
    async with running(make_app(encoder)) as client:
        for _ in range(2):
            response = await client.get("/health")
            assert response.status_code == 200
            assert (await response.get_json())["probed"] is True
        assert encoder.stats().live_requests == 0


async def test_concurrent_checks_share_one_probe(make_app: Callable[..., Quart]) -> None:
    model = GatedModel()
    encoder = Encoder(fast_config(), model=model)
    statuses: list[int] = []
    async with running(make_app(encoder)) as client:

        async def check() -> None:
            statuses.append((await client.get("/health")).status_code)

        async with anyio.create_task_group() as group:
            for _ in range(5):
                group.start_soon(check)
            await anyio.to_thread.run_sync(model.entered.wait, 10)
            await anyio.sleep(0.05)
            model.gate.set()
        assert statuses == [200] * 5
        assert model.forwards == 1, "five checks, one probe"
    assert encoder.stats().live_requests == 0


async def test_probe_is_skipped_while_encodes_make_progress(
    make_app: Callable[..., Quart],
) -> None:
    model = GatedModel()
    encoder = Encoder(fast_config(), model=model)
    async with running(make_app(encoder)) as client:
        async with anyio.create_task_group() as group:

            async def encode() -> None:
                response = await client.post("/encode", json={"req_id": "busy", "mm_items": ["x"]})
                assert response.status_code == 200

            group.start_soon(encode)
            await anyio.to_thread.run_sync(model.entered.wait, 10)
            with anyio.fail_after(5):
                response = await client.get("/health")
            assert response.status_code == 200
            assert await response.get_json() == {"status": "ok", "probed": False}
            model.gate.set()
        await client.post("/release", json={"req_id": "busy"})


async def test_failing_model_is_503(make_app: Callable[..., Quart]) -> None:
    encoder = Encoder(fast_config(), model=GatedModel(fail=True))
    async with running(make_app(encoder)) as client:
        response = await client.get("/health")
        assert response.status_code == 503
        answer = await response.get_json()
        assert answer["status"] == "error"
        assert "probe" in answer["message"]
    assert encoder.stats().live_requests == 0


async def test_slow_model_is_503_after_the_timeout(make_app: Callable[..., Quart]) -> None:
    model = GatedModel()
    encoder = Encoder(fast_config(), model=model)
    async with running(make_app(encoder, health_timeout_s=0.3)) as client:
        response = await client.get("/health")
        assert response.status_code == 503
        assert "0.3" in (await response.get_json())["message"]
        model.gate.set()


async def test_health_probe_of_the_real_model(make_app: Callable[..., Quart]) -> None:
    async with running(make_app()) as client:
        assert (await client.get("/health")).status_code == 200
        # A real image first, then the probe: both work on the tiny tower.
        response = await client.post(
            "/encode", json={"req_id": "real", "mm_items": [png_data_url()]}
        )
        assert response.status_code == 200
        await client.post("/release", json={"req_id": "real"})
        assert (await client.get("/health")).status_code == 200
        text = (await (await client.get("/metrics")).get_data()).decode()
    # Probes are not client requests.
    assert 'encdisagg_requests_total{modality="image",status="ok"} 1.0' in text
    assert "encdisagg_request_seconds_count 1.0" in text
