"""Nothing device-bound on the event loop: the staging arena (on the model's device) is
allocated in a worker thread (checked with a recorder in place of the allocation)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from encdisagg import Encoder, EncoderConfig
from encdisagg.encoder._staging import _owner
from encdisagg.models import NullVisionModel
from encdisagg.transfer import LoopbackEngine, LoopbackFabric

pytestmark = [pytest.mark.anyio, pytest.mark.device]


async def test_the_staging_arena_is_allocated_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: list[int] = []
    original = _owner.StagingArena

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(_owner, "StagingArena", recording)
    config = EncoderConfig(model="null", transfer="loopback", staging_arena_mb=1)
    async with Encoder(config, model=NullVisionModel(), engine=LoopbackEngine(LoopbackFabric())):
        pass
    assert threads
    assert threading.get_ident() not in threads
