"""Audio embeddings (one-element grid rows) through the global tier's entries."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from encdisagg.cache import CachedItem, GlobalCache, parse_global_cache_url
from encdisagg.models import QwenAudioModel, load_model

from ..models._audio_samples import clip
from .fakes import MemoryStore

pytest.importorskip("soundfile")
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def omni() -> QwenAudioModel:
    model = load_model("tiny-qwen2.5-omni-audio")
    assert isinstance(model, QwenAudioModel)
    return model


@pytest.fixture
def listening() -> Iterator[int]:
    """A loopback port that accepts connections (the reachability probe's target)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


async def test_a_global_hit_returns_the_same_bytes_and_grid(
    omni: QwenAudioModel, listening: int
) -> None:
    pre = omni.preprocess([clip(2.7, codec="flac")], "audio")
    assert pre.grid == ((270,),)
    (rows,) = omni.forward([pre])
    settings = parse_global_cache_url(
        f"mooncake://127.0.0.1:{listening}?metadata=http://127.0.0.1:{listening}/m"
    )
    store = MemoryStore()
    cache = GlobalCache(
        settings, hidden_size=omni.hidden_size, dtype=omni.dtype, open_store=lambda _: store
    )
    async with cache:
        assert cache.insert_soon(
            "k", CachedItem(rows=rows, tokens=pre.num_tokens, grid=pre.grid[0])
        )
        await cache.drain()
        found = await cache.lookup(["k"])
    hit = found["k"]
    assert (hit.tokens, hit.grid) == (67, (270,))
    assert hit.rows.numpy().tobytes() == rows.numpy().tobytes()
