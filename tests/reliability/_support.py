"""Shared pieces of the reliability tests: sizes, a slow null model, a running server.

Sizes are small in CI; with ``ENCDISAGG_SOAK=1`` (``python -m benchmarks --soak``) they grow to
soak sizes, and ``ENCDISAGG_SOAK_REPORT`` names a JSON file the soak test writes its figures to.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import sniffio
import torch

from encdisagg import Encoder, EncoderConfig
from encdisagg.models import NullVisionModel, Preprocessed
from encdisagg.pipeline import serve_asgi
from encdisagg.server import ServerSettings, create_app

SOAK = os.environ.get("ENCDISAGG_SOAK") == "1"


def sized(ci: int, soak: int) -> int:
    """``ci`` normally, ``soak`` under ``ENCDISAGG_SOAK=1``."""
    return soak if SOAK else ci


def fast_config(**overrides: Any) -> EncoderConfig:
    """Short bounds, so every failing path fails fast."""
    values: dict[str, Any] = {
        "model": "null",
        "request_timeout_s": 5.0,
        "send_timeout_s": 10.0,
        "zmq_send_timeout_s": 1.0,
        "shutdown_grace_s": 2.0,
        "cleanup_timeout_s": 2.0,
    }
    values.update(overrides)
    return EncoderConfig.from_mapping(values)


class SlowNullModel:
    """``NullVisionModel`` whose forward sleeps first (in its worker thread)."""

    def __init__(self, forward_s: float, *, tokens_per_item: int = 16) -> None:
        self._inner = NullVisionModel(tokens_per_item=tokens_per_item)
        self.forward_s = forward_s
        self.forwards = 0

    @property
    def hidden_size(self) -> int:
        return self._inner.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self._inner.dtype

    def preprocess(self, items: Sequence[object], modality: Any) -> Preprocessed:
        return self._inner.preprocess(items, modality)

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        self.forwards += 1
        time.sleep(self.forward_s)
        return self._inner.forward(batch)


@asynccontextmanager
async def running_server(
    encoder: Encoder, settings: ServerSettings | None = None
) -> AsyncIterator[str]:
    """Serve ``encoder`` with Hypercorn on the test's backend; yields the base URL."""
    flavour = "trio" if sniffio.current_async_library() == "trio" else "asyncio"
    app = create_app(encoder, settings=settings, flavour=flavour)
    async with serve_asgi(app, graceful_timeout_s=2.0, shutdown_timeout_s=10.0) as url:
        yield url


async def wait_idle(encoder: Encoder, bound_s: float = 10.0) -> None:
    """Wait (bounded) until the encoder holds nothing; fail with its stats otherwise."""
    with anyio.move_on_after(bound_s):
        while True:
            stats = encoder.stats()
            if not (stats.live_requests or stats.staged_bytes or stats.inflight_transfers):
                return
            await anyio.sleep(0.02)
    raise AssertionError(f"the encoder is not idle after {bound_s} s: {encoder.stats()}")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")  # pragma: no cover - not Linux


def write_soak_report(section: str, data: dict[str, Any]) -> None:
    """Merge ``data`` under ``section`` into the soak report, if one was asked for."""
    path = os.environ.get("ENCDISAGG_SOAK_REPORT")
    if not path:
        return
    report_path = Path(path)
    report: dict[str, Any] = {}
    if report_path.exists():
        report = json.loads(report_path.read_text())
    report.setdefault("sections", {})[section] = data
    report["headline"] = [
        row for sec in report["sections"].values() for row in sec.get("headline", [])
    ]
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
