"""Fixtures of the receiver tests: the tiny model, images, an encoder behind real HTTP."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager

import anyio
import pytest
import torch
from anyio.from_thread import start_blocking_portal
from PIL import Image

from encdisagg import Encoder, EncoderConfig
from encdisagg.models import QwenVisionModel, load_model
from encdisagg.pipeline import serve_asgi
from encdisagg.transfer import MooncakeEngine, TransferEngine

from ._encoder_app import Faults, FaultyApp


@pytest.fixture(scope="session")
def tiny() -> QwenVisionModel:
    return load_model("tiny")


@pytest.fixture(scope="session")
def mooncake_engines() -> Iterator[tuple[MooncakeEngine, MooncakeEngine]]:
    """Two running Mooncake engines (TCP, loopback), shared by the session: each takes about a
    second to stop. Their methods block and need no event loop."""
    with start_blocking_portal() as portal, ExitStack() as stack:
        first = stack.enter_context(portal.wrap_async_context_manager(MooncakeEngine()))
        second = stack.enter_context(portal.wrap_async_context_manager(MooncakeEngine()))
        yield first, second


def data_url(width: int, height: int, seed: int = 0) -> str:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@asynccontextmanager
async def encoder_server(
    model: QwenVisionModel,
    *,
    transfer: str = "zmq",
    engine: TransferEngine | None = None,
    faults: Faults | None = None,
) -> AsyncIterator[tuple[str, Encoder, Faults]]:
    """A real Encoder behind real HTTP (Hypercorn), on the current backend."""
    faults = faults or Faults()
    config = EncoderConfig(transfer=transfer, request_timeout_s=30.0, send_timeout_s=30.0)
    async with Encoder(config, model=model, engine=engine) as encoder:
        async with serve_asgi(FaultyApp(encoder, faults)) as url:
            yield url, encoder, faults
        # A release that arrives while its encode is in flight completes when the encode
        # ends (DESIGN 4.5): give such encodes a moment to end.
        with anyio.move_on_after(5.0):
            while encoder.stats().live_requests:
                await anyio.sleep(0.01)
        stats = encoder.stats()
        assert stats.live_requests == 0, stats
        assert stats.staged_bytes == 0, stats
