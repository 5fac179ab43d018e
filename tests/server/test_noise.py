"""Third-party noise under ``encdisagg serve``: Pillow's debug records stay out unless
asked for; Mooncake's level follows --log-level."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator

import pytest
from PIL import Image
from transformers.utils import logging as transformers_logging

from encdisagg.server._serve._noise import quiet_third_party

from ._helpers import png_bytes


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    monkeypatch.delenv("ENCDISAGG_MC_LOG_LEVEL_DEFAULTED", raising=False)
    monkeypatch.delenv("ENCDISAGG_THIRD_PARTY_DEBUG", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    pil = logging.getLogger("PIL")
    level = pil.level
    bars = transformers_logging.is_progress_bar_enabled()
    yield
    pil.setLevel(level)
    if bars:
        transformers_logging.enable_progress_bar()


def _pil_debug_records(caplog: pytest.LogCaptureFixture) -> int:
    caplog.clear()
    Image.open(io.BytesIO(png_bytes(8, 8))).load()
    return sum(1 for r in caplog.records if r.name.startswith("PIL") and r.levelno == logging.DEBUG)


@pytest.mark.usefixtures("restored")
def test_pillow_debug_is_quiet_even_at_debug_level(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    logging.getLogger("PIL").setLevel(logging.NOTSET)
    assert _pil_debug_records(caplog) > 0, "Pillow does log each PNG chunk"
    quiet_third_party("debug")
    assert _pil_debug_records(caplog) == 0
    assert "MC_LOG_LEVEL" not in os.environ, "debug: Mooncake keeps its own level"
    monkeypatch.setenv("ENCDISAGG_THIRD_PARTY_DEBUG", "1")
    quiet_third_party("debug")
    assert _pil_debug_records(caplog) > 0, "asked for"


@pytest.mark.usefixtures("restored")
def test_mooncake_warnings_and_no_progress_bars_below_debug() -> None:
    transformers_logging.enable_progress_bar()
    quiet_third_party("debug")
    assert transformers_logging.is_progress_bar_enabled()
    quiet_third_party("info")
    assert os.environ["MC_LOG_LEVEL"] == "WARNING"
    assert not transformers_logging.is_progress_bar_enabled()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1", "workers inherit it"
