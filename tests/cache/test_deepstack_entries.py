"""Qwen3-VL's joint embeddings (main + deepstack sections) through the global tier's entries."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from encdisagg.cache import CachedItem, GlobalCache, parse_global_cache_url
from encdisagg.models import Qwen3VisionModel, load_model

from .fakes import MemoryStore

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def qwen3() -> Qwen3VisionModel:
    model = load_model("tiny-qwen3-vl")
    assert isinstance(model, Qwen3VisionModel)
    return model


@pytest.fixture
def listening() -> Iterator[int]:
    """A loopback port that accepts connections (the reachability probe's target)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


async def test_a_global_hit_returns_the_same_bytes_and_sections(
    qwen3: Qwen3VisionModel, listening: int
) -> None:
    pixels = np.random.default_rng(5).integers(0, 256, (70, 100, 3), dtype=np.uint8)
    pre = qwen3.preprocess([Image.fromarray(pixels, "RGB")], "image")
    (rows,) = qwen3.forward([pre])
    settings = parse_global_cache_url(
        f"mooncake://127.0.0.1:{listening}?metadata=http://127.0.0.1:{listening}/m"
    )
    store = MemoryStore()
    cache = GlobalCache(
        settings, hidden_size=qwen3.hidden_size, dtype=qwen3.dtype, open_store=lambda _: store
    )
    async with cache:
        assert cache.insert_soon(
            "k", CachedItem(rows=rows, tokens=pre.num_tokens, grid=pre.grid[0])
        )
        await cache.drain()
        found = await cache.lookup(["k"])
    hit = found["k"]
    assert (hit.tokens, hit.grid) == (pre.num_tokens, pre.grid[0])
    assert hit.rows.numpy().tobytes() == rows.numpy().tobytes()
    layout = qwen3.embedding_layout
    for name, section in layout.split(hit.rows).items():
        assert torch.equal(section, layout.split(rows)[name])
