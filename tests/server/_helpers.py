"""Helpers of the server tests: real PNG images, short-bounded configs, a running app."""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from PIL import Image
from quart import Quart
from quart.typing import TestClientProtocol

from encdisagg import EncoderConfig
from encdisagg.server import DataParallelBackend, ServerSettings

#: A stand-in worker that records its config file and arguments (see the script).
RECORDING_WORKER = str(Path(__file__).with_name("config_recording_worker.py"))


def png_bytes(width: int = 224, height: int = 224, seed: int = 0) -> bytes:
    """A real PNG with a gradient; different seeds give different pixels."""
    image = Image.new("RGB", (width, height))
    image.putdata(
        [
            ((x * 7 + seed) % 256, (y * 5 + 3 * seed) % 256, (x + y + seed) % 256)
            for y in range(height)
            for x in range(width)
        ]
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png_data_url(width: int = 224, height: int = 224, seed: int = 0) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, seed)).decode()


def fast_config(**overrides: Any) -> EncoderConfig:
    """The tiny model with short bounds, so failing paths fail fast."""
    values: dict[str, Any] = {
        "model": "tiny",
        "request_timeout_s": 10.0,
        "send_timeout_s": 10.0,
        "zmq_send_timeout_s": 5.0,
        "shutdown_grace_s": 5.0,
        "cleanup_timeout_s": 5.0,
    }
    values.update(overrides)
    return EncoderConfig.from_mapping(values)


@asynccontextmanager
async def running(app: Quart) -> AsyncIterator[TestClientProtocol]:
    """Run ``app``'s lifespan and yield a test client.

    The lifespan may start worker processes (each imports torch): Quart's 6 s default
    startup bound is too short for that on a busy machine.
    """
    async with app.test_app_class(app, startup_timeout=120, shutdown_timeout=120) as test_app:
        yield test_app.test_client()


async def start_and_stop_recording_workers(
    config: EncoderConfig, settings: ServerSettings, folder: Path
) -> None:
    """Start ``settings.dp`` recording workers behind a data-parallel front, then stop them:
    each leaves ``config-RANK.json`` and ``argv-RANK.json`` in ``folder``."""
    backend = DataParallelBackend(
        config,
        workers=settings.dp,
        settings=settings,
        worker_command=[sys.executable, RECORDING_WORKER, "--script", "echo", "--log", str(folder)],
    )
    async with backend:
        pass
