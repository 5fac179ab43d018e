"""Fixtures of the server tests.

Every ``@pytest.mark.anyio`` test runs on asyncio and on Trio; on asyncio the app is a
``Quart`` app driven by Quart's test client, on Trio a ``QuartTrio`` app driven by
QuartTrio's test client, so one suite covers both flavours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from quart import Quart

from encdisagg import Encoder, EncoderConfig
from encdisagg.server import ServerSettings, create_app

from ._helpers import fast_config


@pytest.fixture
def flavour(anyio_backend_name: str) -> str:
    """``"asyncio"`` (Quart) or ``"trio"`` (QuartTrio), following the test's backend."""
    return anyio_backend_name


@pytest.fixture
def make_app(flavour: str) -> Callable[..., Quart]:
    """``make_app(config_or_encoder=None, **settings)`` → an app of the test's flavour."""

    def make(source: EncoderConfig | Encoder | None = None, **settings: Any) -> Quart:
        return create_app(
            source if source is not None else fast_config(),
            settings=ServerSettings(**settings),
            flavour=flavour,  # type: ignore[arg-type]
        )

    return make
