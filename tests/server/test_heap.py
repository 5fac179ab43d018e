"""The server freezes what startup left alive, so full collections skip it."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from encdisagg import BadRequestError, EncoderConfig
from encdisagg.server import ServerSettings
from encdisagg.server._backend import LocalBackend
from encdisagg.server._heap import freeze_startup_heap

from ._helpers import start_and_stop_recording_workers


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Leave the test process's collector as it was: nothing frozen before or after."""
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_freezing_moves_the_survivors_out_of_the_collectors_reach(unfrozen: None) -> None:
    survivor = [object()]
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() > 0
    # Frozen objects are no longer among those the collector tracks and visits.
    assert not any(obj is survivor for obj in gc.get_objects())
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert any(obj is survivor for obj in gc.get_objects())


def test_freeze_heap_is_off_for_an_embedded_app_and_must_be_a_bool() -> None:
    assert ServerSettings().freeze_heap is False
    with pytest.raises(BadRequestError, match="freeze_heap"):
        ServerSettings(freeze_heap=1)  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize("freeze", [False, True])
async def test_the_backend_freezes_once_the_encoder_is_open(unfrozen: None, freeze: bool) -> None:
    config = EncoderConfig(model="null", transfer="loopback")
    async with LocalBackend(config, freeze_heap=freeze) as backend:
        assert backend.encoder.is_open
        assert (gc.get_freeze_count() > 0) is freeze


@pytest.mark.anyio
@pytest.mark.parametrize("freeze", [False, True])
async def test_every_data_parallel_worker_is_told_to_freeze(tmp_path: Path, freeze: bool) -> None:
    settings = ServerSettings(
        dp=2, freeze_heap=freeze, worker_start_timeout_s=20, worker_stop_timeout_s=2
    )
    await start_and_stop_recording_workers(EncoderConfig(model="null"), settings, tmp_path)
    for rank in (0, 1):
        argv = json.loads((tmp_path / f"argv-{rank}.json").read_text())
        assert ("--freeze-heap" in argv) is freeze
