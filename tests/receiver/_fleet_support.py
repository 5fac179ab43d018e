"""Encoders that register in a real etcd, for the fleet tests: the null model behind real
HTTP, with a :class:`Registration` whose load is the Encoder's own figures."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from encdisagg import Encoder, EncoderConfig, Modality
from encdisagg.models import NullVisionModel
from encdisagg.pipeline import serve_asgi
from encdisagg.registry import EncoderLoad, EncoderRecord, Registration
from tests.registry._etcd_server import EtcdServer, run_etcd

from ._encoder_app import Faults, FaultyApp

ALL = (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO)
MODEL = NullVisionModel()


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    with run_etcd() as server:
        yield server


def expected(items: list[str]) -> torch.Tensor:
    """What the null model makes of ``items`` as one part."""
    return torch.cat(MODEL.forward([MODEL.preprocess(items, Modality.IMAGE)]))


class Hold:
    """ASGI middleware: holds every ``/encode`` until :meth:`open`, then answers 503
    (``refuse``) or serves it."""

    def __init__(self, app: Any, *, refuse: bool) -> None:
        self.app = app
        self.refuse = refuse
        self.held = 0
        self._gate = anyio.Event()
        self._arrived = anyio.Event()

    def open(self) -> None:
        self._gate.set()

    async def wait_held(self) -> None:
        """Return once an ``/encode`` is held here (at once if one was)."""
        await self._arrived.wait()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != "/encode":
            await self.app(scope, receive, send)
            return
        self.held += 1
        self._arrived.set()
        await self._gate.wait()
        if not self.refuse:
            await self.app(scope, receive, send)
            return
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"status":"error","message":"held"}'})


@asynccontextmanager
async def fleet_encoder(
    registry: str,
    *,
    faults: Faults | None = None,
    hold: str | None = None,
    load: Callable[[], Awaitable[EncoderLoad]] | None = None,
    retry_s: float = 0.1,
) -> AsyncIterator[tuple[str, Faults, Registration, Hold | None]]:
    """An encoder server registered under ``registry`` for the block; ``hold``
    (``"refuse"`` or ``"serve"``) puts a :class:`Hold` in front of it."""
    faults = faults or Faults()
    config = EncoderConfig(request_timeout_s=30.0, send_timeout_s=30.0)
    async with Encoder(config, model=NullVisionModel()) as encoder:

        async def own_load() -> EncoderLoad:
            stats = encoder.stats()
            return EncoderLoad(stats.live_requests, stats.staged_bytes)

        app: Any = FaultyApp(encoder, faults)
        gate = None if hold is None else Hold(app, refuse=hold == "refuse")
        async with serve_asgi(gate or app) as url:
            record = EncoderRecord(
                url=url, model="null", modalities=ALL, transfers=("zmq",), capacity=8
            )
            registration = Registration(
                registry,
                record,
                load=load or own_load,
                lease_ttl_s=2,
                refresh_s=0.1,
                retry_s=retry_s,
            )
            try:
                async with registration:
                    await registration.wait_registered()
                    yield url, faults, registration, gate
            finally:
                if gate is not None:
                    gate.open()
