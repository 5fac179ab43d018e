"""Encoders sharing embeddings through a real Mooncake Store (master and storage on loopback)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from encdisagg import BadRequestError, Encoder, EncoderConfig, EncodeRequest, Modality
from encdisagg._video_timing import video_timing
from encdisagg.cache import (
    GlobalCacheStats,
    KeySpace,
    MooncakeEmbeddingStore,
    entry_header,
    read_entry,
)
from encdisagg.encoder import EncoderEvents, ZmqDestination
from encdisagg.models import QwenVisionModel, load_model
from encdisagg.transfer import ZmqReceiver, payload_view

from ._cluster import Cluster
from .fakes import CountingModel

pytestmark = pytest.mark.anyio

MakeImage = Callable[..., bytes]

# Each test uses its own images (seeds), so entries of one test never serve another.


@asynccontextmanager
async def open_encoder(
    cluster: Cluster, model: Any, *, events: EncoderEvents | None = None, **config: Any
) -> AsyncIterator[Encoder]:
    settings = {"global_cache": cluster.url(), **config}
    async with Encoder(EncoderConfig.from_mapping(settings), model=model, events=events) as enc:
        assert enc.global_cache is not None
        assert enc.global_cache.connected
        yield enc
        await enc.global_cache.drain()
    assert enc.stats().live_requests == 0


async def received(encoder: Encoder, request: EncodeRequest) -> tuple[Any, torch.Tensor]:
    """Encode ``request``, deliver it over ZMQ, and return the result and the rows."""
    async with ZmqReceiver() as receiver:
        result = await encoder.encode(request)
        await encoder.send(request.req_id, ZmqDestination(receiver.url))
        with anyio.fail_after(30):
            part = await receiver.receive()
    assert part.tensor is not None
    return result, part.tensor


def full_encode(model: QwenVisionModel, items: list[object]) -> tuple[Any, torch.Tensor]:
    pre = model.preprocess(items, Modality.IMAGE)
    return pre, torch.cat(model.forward([pre]))


def stats_of(encoder: Encoder) -> GlobalCacheStats:
    stats = encoder.global_cache_stats()
    assert stats is not None
    return stats


async def test_a_second_encoder_serves_what_the_first_encoded_without_a_forward(
    cluster: Cluster, tiny: QwenVisionModel, image: MakeImage
) -> None:
    items: list[object] = [image(101), image(102), image(101)]  # a repeat is computed once
    first = CountingModel(tiny)
    async with open_encoder(cluster, first) as encoder:
        result_a, rows_a = await received(encoder, EncodeRequest("a", items))
        assert first.forwarded == 2
        assert stats_of(encoder).misses == 2
    assert stats_of(encoder).inserts == 2

    second = CountingModel(tiny)
    async with open_encoder(cluster, second) as encoder:
        result_b, rows_b = await received(encoder, EncodeRequest("b", items))
        assert second.forwarded == 0
        assert second.preprocessed == 0
        stats = stats_of(encoder)
        assert (stats.hits, stats.misses, stats.fallbacks) == (2, 0, 0)
    assert result_b.token_counts == result_a.token_counts == (4, 4, 4)
    assert result_b.grid == result_a.grid
    assert torch.equal(rows_b, rows_a)
    pre, expected = full_encode(tiny, items)
    assert result_b.grid == pre.grid
    torch.testing.assert_close(rows_b, expected)


async def test_a_half_cached_request_forwards_only_its_misses(
    cluster: Cluster, tiny: QwenVisionModel, image: MakeImage
) -> None:
    items: list[object] = [image(201), image(202, 84, 56), image(203), image(204, 56, 112)]
    warm = CountingModel(tiny)
    async with open_encoder(cluster, warm) as encoder:
        await received(encoder, EncodeRequest("warm", [items[1], items[3]]))
    counting = CountingModel(tiny)
    async with open_encoder(cluster, counting) as encoder:
        result, rows = await received(encoder, EncodeRequest("half", items))
        assert counting.forwarded == 2
        assert counting.preprocessed == 2
        stats = stats_of(encoder)
        assert (stats.hits, stats.misses) == (2, 2)
    pre, expected = full_encode(tiny, items)
    assert result.token_counts == pre.token_counts
    assert result.grid == pre.grid
    assert result.num_tokens == sum(pre.token_counts)
    torch.testing.assert_close(rows, expected)


async def test_caller_hashes_key_the_items_and_skip_preprocessing(
    cluster: Cluster, tiny: QwenVisionModel, image: MakeImage, salt: str
) -> None:
    items: list[object] = [image(301), image(302)]
    hashes = [f"caller-hash-301-{salt}", f"caller-hash-302-{salt}"]
    async with open_encoder(cluster, CountingModel(tiny)) as encoder:
        _, rows_a = await received(encoder, EncodeRequest("a", items, hashes=hashes))
    counting = CountingModel(tiny)
    async with open_encoder(cluster, counting) as encoder:
        # The hashes alone find the entries: the items are never looked at.
        _, rows_b = await received(encoder, EncodeRequest("b", items, hashes=hashes))
        assert (counting.preprocessed, counting.forwarded) == (0, 0)
        # Content keys and caller hashes never share entries.
        await received(encoder, EncodeRequest("c", items))
        assert counting.forwarded == 2
    assert torch.equal(rows_a, rows_b)


async def test_items_named_by_path_are_keyed_by_preprocessing_them(
    cluster: Cluster, tiny: QwenVisionModel, tmp_path: Path, image: MakeImage
) -> None:
    path = tmp_path / "picture.png"
    path.write_bytes(image(401))
    async with open_encoder(cluster, CountingModel(tiny)) as encoder:
        await received(encoder, EncodeRequest("a", [str(path), image(402)]))
    counting = CountingModel(tiny)
    async with open_encoder(cluster, counting) as encoder:
        await received(encoder, EncodeRequest("b", [str(path), image(402)]))
        assert counting.preprocessed == 1  # the file, read to learn its key
        assert counting.forwarded == 0


async def test_a_corrupt_entry_is_evicted_and_recomputed(
    cluster: Cluster, tiny: QwenVisionModel, store: MooncakeEmbeddingStore, image: MakeImage
) -> None:
    item = image(501)
    key = KeySpace.for_model(tiny).for_modality("image").for_content(item, max_media_bytes=1 << 26)
    assert key is not None
    # A header for 4 tokens, but the rows of 3.
    rows = torch.zeros(3, tiny.hidden_size, dtype=tiny.dtype)
    await anyio.to_thread.run_sync(
        store.put, key, entry_header(4, tiny.hidden_size, tiny.dtype, (1, 4, 4)), payload_view(rows)
    )
    counting = CountingModel(tiny)
    async with open_encoder(cluster, counting) as encoder:
        result, received_rows = await received(encoder, EncodeRequest("corrupt", [item]))
        assert counting.forwarded == 1
        await encoder.global_cache.drain()  # type: ignore[union-attr]
        stats = stats_of(encoder)
        assert (stats.invalid, stats.hits, stats.evictions) == (1, 0, 1)
        # Evicted, then the recomputed entry took its place.
        assert stats.inserts == 1
    assert result.token_counts == (4,)
    (value,) = await anyio.to_thread.run_sync(store.fetch, [key])
    assert value is not None
    entry = read_entry(value, hidden=tiny.hidden_size, dtype=tiny.dtype)
    assert entry.tokens == 4
    assert torch.equal(entry.rows, received_rows)


async def test_a_local_tier_in_front_answers_repeats_without_the_store(
    cluster: Cluster, tiny: QwenVisionModel, image: MakeImage
) -> None:
    local: list[str] = []
    events = EncoderEvents(on_cache=local.append)
    items: list[object] = [image(601), image(602)]
    counting = CountingModel(tiny)
    async with open_encoder(cluster, counting, events=events, prefix_cache_mb=16) as encoder:
        await received(encoder, EncodeRequest("a", items))
        await received(encoder, EncodeRequest("b", items[::-1]))
        assert counting.forwarded == 2
        stats = stats_of(encoder)
        assert (stats.hits, stats.misses) == (0, 2)  # the repeat never reached the store
        assert local == ["miss", "miss", "hit", "hit"]
        assert encoder.stats().cache_entries == 2


async def test_bad_items_are_named_by_their_place_in_the_request(
    cluster: Cluster, tiny: QwenVisionModel, image: MakeImage
) -> None:
    good = image(701)
    async with open_encoder(cluster, CountingModel(tiny)) as encoder:
        await received(encoder, EncodeRequest("warm", [good]))
        with pytest.raises(BadRequestError, match=r"mm_items\[1\]"):
            await encoder.encode(EncodeRequest("bad", [good, b"not an image"]))


async def test_a_video_keeps_its_timing_and_leaves_the_global_tier_alone(
    cluster: Cluster, image: MakeImage
) -> None:
    """The global tier stores rows and grids, not a video's timing (which comes from the
    request's fps at preprocessing): a video is encoded past it, its timing intact."""
    model = CountingModel(load_model("tiny-qwen2.5-vl"))
    frames = [image(300 + n) for n in range(5)]
    async with (
        open_encoder(cluster, model, prefix_cache_mb=64) as encoder,
        ZmqReceiver() as receiver,
    ):
        request = EncodeRequest("v", [{"frames": frames, "fps": 4}], modality="video")
        result = await encoder.encode(request)
        await encoder.send("v", ZmqDestination(receiver.url))
        with anyio.fail_after(30):
            part = await receiver.receive()
        # The same frames at another rate: the local tier's rows, this request's timing.
        again = await encoder.encode(EncodeRequest("w", [{"frames": frames}], modality="video"))
        await encoder.release("w")
        stats = stats_of(encoder)
    assert result.video_timing == (video_timing(5, 2, fps=4),)
    assert part.header.video_timing == result.video_timing
    assert again.video_timing == (video_timing(5, 2, fps=2),)
    assert model.forwarded == 1
    assert (stats.hits, stats.misses, stats.inserts) == (0, 0, 0)
