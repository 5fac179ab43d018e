"""How the Encoder takes the global_cache setting (no store needed for these)."""

from __future__ import annotations

import pytest

from encdisagg import BadRequestError, Encoder, EncoderConfig
from encdisagg.models import NullVisionModel

pytestmark = pytest.mark.anyio


async def test_a_bad_url_fails_the_open_by_naming_its_part() -> None:
    config = EncoderConfig(global_cache="mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE")
    with pytest.raises(BadRequestError, match="global_cache: query parameter 'metadata'"):
        async with Encoder(config, model=NullVisionModel()):
            pass


async def test_a_model_without_identity_cannot_share_a_cache() -> None:
    config = EncoderConfig(
        global_cache="mooncake://127.0.0.1:1?metadata=http://127.0.0.1:1/metadata"
    )
    with pytest.raises(BadRequestError, match="'identity'"):
        async with Encoder(config, model=NullVisionModel()):
            pass


async def test_off_by_default() -> None:
    async with Encoder(model=NullVisionModel()) as encoder:
        assert encoder.global_cache is None
        assert encoder.global_cache_stats() is None
