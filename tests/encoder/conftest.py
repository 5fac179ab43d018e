from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from encdisagg import Encoder, EncoderConfig
from encdisagg.encoder import EncoderEvents

from .fakes import RecordingEngine, ScriptedModel


@pytest.fixture
def opened_encoders() -> list[Encoder]:
    return []


@pytest.fixture(autouse=True)
def encoders_end_idle(opened_encoders: list[Encoder]) -> Iterator[None]:
    """Every encoder a test made must hold nothing once the test is over."""
    yield
    for encoder in opened_encoders:
        stats = encoder.stats()
        assert stats.live_requests == 0, stats
        assert stats.staged_bytes == 0, stats
        assert stats.inflight_transfers == 0, stats
        assert stats.registered_regions == 0, stats
        engine = encoder.engine
        if isinstance(engine, RecordingEngine):
            assert engine.violations == []
            assert engine.regions == {}, "registrations leaked"


@pytest.fixture
def make_encoder(opened_encoders: list[Encoder]) -> Callable[..., Encoder]:
    """``make_encoder(model=..., engine=..., events=..., **config)`` → an Encoder checked
    after the test.

    The staging arena is off unless a test sets ``staging_arena_mb``: most tests here pin
    down the per-request registration path (the arena's fallback); the arena has its own.
    """

    def make(
        *, model: Any = None, engine: Any = None, events: EncoderEvents | None = None, **config: Any
    ) -> Encoder:
        config.setdefault("staging_arena_mb", 0)
        encoder = Encoder(
            EncoderConfig.from_mapping(config),
            model=model if model is not None else ScriptedModel(),
            engine=engine,
            events=events,
        )
        opened_encoders.append(encoder)
        return encoder

    return make
