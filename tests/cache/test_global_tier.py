"""The global tier's failure policy against an in-memory store with failure switches."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from encdisagg import TransferError
from encdisagg.cache import (
    CachedItem,
    EmbeddingStore,
    GlobalCache,
    GlobalCacheSettings,
    parse_global_cache_url,
)

from .fakes import MemoryStore, store_down

pytestmark = pytest.mark.anyio

HIDDEN = 4


@pytest.fixture
def url(listening: int) -> Callable[..., GlobalCacheSettings]:
    def make(**params: object) -> GlobalCacheSettings:
        query = "".join(f"&{name}={value}" for name, value in params.items())
        return parse_global_cache_url(
            f"mooncake://127.0.0.1:{listening}?metadata=http://127.0.0.1:{listening}/m{query}"
        )

    return make


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.breaker: list[str] = []

    def cache(
        self, settings: GlobalCacheSettings, store: EmbeddingStore | Callable[..., Any]
    ) -> GlobalCache:
        opener = (
            store if callable(store) and not isinstance(store, MemoryStore) else (lambda _: store)
        )
        return GlobalCache(
            settings,
            hidden_size=HIDDEN,
            dtype=torch.float32,
            open_store=opener,
            on_event=lambda name, n: self.events.append((name, n)),
            on_breaker=self.breaker.append,
        )


def item(value: float, tokens: int = 2) -> CachedItem:
    return CachedItem(
        rows=torch.full((tokens, HIDDEN), value), tokens=tokens, grid=(1, 2, 2 * tokens)
    )


async def test_an_inserted_item_is_found_again(url: Callable[..., GlobalCacheSettings]) -> None:
    store, recorder = MemoryStore(), Recorder()
    async with recorder.cache(url(), store) as cache:
        assert cache.connected
        assert cache.insert_soon("k1", item(1.5, 3))
        await cache.drain()
        found = await cache.lookup(["k1", "k2", "k1"])
        assert list(found) == ["k1"]
        assert torch.equal(found["k1"].rows, item(1.5, 3).rows)
        assert (found["k1"].tokens, found["k1"].grid) == (3, (1, 2, 6))
        stats = cache.stats()
        assert (stats.inserts, stats.hits, stats.misses, stats.breaker) == (1, 1, 1, "closed")
    assert store.closed
    assert recorder.events == [("insert", 1), ("hit", 1), ("miss", 1)]
    assert store.count("exists") == 1  # the duplicate key was looked up once


async def test_failed_lookups_fall_back_then_open_the_breaker(
    url: Callable[..., GlobalCacheSettings],
) -> None:
    store, recorder = MemoryStore(), Recorder()
    store.fail["exists"] = store_down()
    async with recorder.cache(url(failures=2, cooldown_s=600), store) as cache:
        assert await cache.lookup(["a", "b"]) == {}
        assert cache.stats().breaker == "closed"
        assert await cache.lookup(["c"]) == {}
        assert cache.stats().breaker == "open"
        # Open: the store is not asked at all, and nothing is inserted.
        assert await cache.lookup(["d", "e"]) == {}
        assert not cache.insert_soon("f", item(1.0))
        assert store.count("exists") == 2
        stats = cache.stats()
        assert (stats.lookup_failures, stats.fallbacks, stats.skipped) == (2, 3, 2)
        assert (stats.inserts_dropped, stats.breaker_opens) == (1, 1)
    assert recorder.breaker == ["open"]
    assert ("fallback", 2) in recorder.events
    assert ("skipped", 2) in recorder.events


@pytest.mark.virtual_time
async def test_the_breaker_probes_after_the_cooldown(
    url: Callable[..., GlobalCacheSettings],
) -> None:
    store, recorder = MemoryStore(), Recorder()
    store.fail["exists"] = store_down()
    async with recorder.cache(url(failures=1, cooldown_s=60), store) as cache:
        await cache.lookup(["a"])
        await anyio.sleep(59)
        await cache.lookup(["a"])
        assert store.count("exists") == 1
        await anyio.sleep(1)
        await cache.lookup(["a"])  # the probe fails: open again, for a fresh cool-down
        assert store.count("exists") == 2
        assert cache.stats().breaker == "open"
        del store.fail["exists"]
        await anyio.sleep(60)
        assert await cache.lookup(["a"]) == {}  # the probe works
        assert cache.stats().breaker == "closed"
    assert recorder.breaker == ["open", "half_open", "open", "half_open", "closed"]


@pytest.mark.virtual_time
async def test_a_stalled_store_costs_a_request_at_most_the_timeout(
    url: Callable[..., GlobalCacheSettings],
) -> None:
    store, recorder = MemoryStore(), Recorder()
    async with recorder.cache(url(timeout_ms=400), store) as cache:
        store.gate = threading.Event()
        started = anyio.current_time()
        assert await cache.lookup(["a"]) == {}
        assert anyio.current_time() - started == pytest.approx(0.4, abs=0.05)
        assert cache.stats().lookup_failures == 1
        # The call itself still runs, owned by the cache; closing waits for it.
        store.gate.set()
    assert store.closed


async def test_unreadable_entries_are_recomputed(url: Callable[..., GlobalCacheSettings]) -> None:
    store, recorder = MemoryStore(), Recorder()
    async with recorder.cache(url(), store) as cache:
        cache.insert_soon("a", item(1.0))
        cache.insert_soon("b", item(2.0))
        await cache.drain()
        store.gone.add("a")
        found = await cache.lookup(["a", "b"])
        assert list(found) == ["b"]
        stats = cache.stats()
        assert (stats.fallbacks, stats.fetch_failures, stats.hits) == (1, 1, 1)
        store.fail["fetch"] = TransferError("fetch broke")
        assert await cache.lookup(["a", "b"]) == {}
        assert cache.stats().fallbacks == 3


async def test_invalid_entries_are_evicted(
    url: Callable[..., GlobalCacheSettings], caplog: pytest.LogCaptureFixture
) -> None:
    store, recorder = MemoryStore(), Recorder()
    store.values["bad"] = b"definitely not an entry"
    async with recorder.cache(url(), store) as cache:
        with caplog.at_level(logging.WARNING, "encdisagg.cache"):
            assert await cache.lookup(["bad"]) == {}
        await cache.drain()
        stats = cache.stats()
        assert (stats.invalid, stats.evictions, stats.hits) == (1, 1, 0)
    assert "bad" not in store.values
    assert "is invalid" in caplog.text


async def test_an_invalid_entry_is_evicted_before_its_recomputed_rows_are_inserted(
    url: Callable[..., GlobalCacheSettings],
) -> None:
    store, recorder = MemoryStore(), Recorder()
    store.values["k"] = b"definitely not an entry"
    async with recorder.cache(url(), store) as cache:
        removing, release = store.entered("remove"), store.hold("remove")
        assert await cache.lookup(["k"]) == {}
        # The eviction runs in its thread and stays there; the rows, recomputed, come in.
        assert await anyio.to_thread.run_sync(removing.wait, 10)
        assert cache.insert_soon("k", item(5.0))
        # The second background thread is free, but the insert waits for the eviction.
        assert not await anyio.to_thread.run_sync(store.entered("put").wait, 0.3)
        release.set()
        await cache.drain()
        assert [call for call, _ in store.calls if call in ("remove", "put")] == [
            "remove",
            "put",
        ]
        found = await cache.lookup(["k"])
    assert torch.equal(found["k"].rows, item(5.0).rows)
    assert (cache.stats().evictions, cache.stats().inserts) == (1, 1)


async def test_failed_inserts_are_logged_and_counted(
    url: Callable[..., GlobalCacheSettings], caplog: pytest.LogCaptureFixture
) -> None:
    store, recorder = MemoryStore(), Recorder()
    store.fail["put"] = TransferError(
        "mooncake store put of k failed (rc=-200 NO_AVAILABLE_HANDLE)"
    )
    async with recorder.cache(url(), store) as cache:
        with caplog.at_level(logging.WARNING, "encdisagg.cache"):
            assert cache.insert_soon("k", item(1.0))
            await cache.drain()
        assert cache.stats().insert_failures == 1
    assert "NO_AVAILABLE_HANDLE" in caplog.text
    assert ("insert_failure", 1) in recorder.events


async def test_inserts_past_the_bound_are_dropped(url: Callable[..., GlobalCacheSettings]) -> None:
    store, recorder = MemoryStore(), Recorder()
    async with recorder.cache(url(max_pending_inserts=1), store) as cache:
        store.gate = threading.Event()
        assert cache.insert_soon("a", item(1.0))
        assert not cache.insert_soon("b", item(2.0))
        assert cache.stats().pending == 1
        store.gate.set()
        await cache.drain()
        assert cache.stats().pending == 0
        assert cache.insert_soon("b", item(2.0))
        await cache.drain()
        assert (cache.stats().inserts, cache.stats().inserts_dropped) == (2, 1)


async def test_invalid_rows_are_never_cached(url: Callable[..., GlobalCacheSettings]) -> None:
    store, recorder = MemoryStore(), Recorder()
    async with recorder.cache(url(), store) as cache:
        wrong = [
            CachedItem(rows=torch.zeros(3, HIDDEN), tokens=2, grid=(1,)),
            CachedItem(rows=torch.zeros(2, HIDDEN + 1), tokens=2, grid=(1,)),
            CachedItem(rows=torch.zeros(2, HIDDEN, dtype=torch.float16), tokens=2, grid=(1,)),
        ]
        assert not any(cache.insert_soon(f"k{i}", bad) for i, bad in enumerate(wrong))
        assert cache.stats().inserts_dropped == 3
    assert store.count("put") == 0


@pytest.mark.virtual_time
async def test_an_unavailable_store_is_retried_in_the_background(
    url: Callable[..., GlobalCacheSettings],
) -> None:
    store, recorder = MemoryStore(), Recorder()
    attempts: list[int] = []

    def open_store(_: GlobalCacheSettings) -> MemoryStore:
        attempts.append(1)
        if len(attempts) == 1:
            raise TransferError("mooncake store setup failed (rc=-900 RPC_FAIL)")
        return store

    async with recorder.cache(url(cooldown_s=30), open_store) as cache:
        assert not cache.connected
        assert await cache.lookup(["a"]) == {}
        assert not cache.insert_soon("a", item(1.0))
        await anyio.sleep(31)
        assert cache.connected
        assert cache.stats().connect_failures == 1
        assert cache.insert_soon("a", item(1.0))
        await cache.drain()
        assert list(await cache.lookup(["a"])) == ["a"]
    assert store.closed


async def test_an_unreachable_master_is_not_set_up(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        settings = parse_global_cache_url(
            f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{port}/m&cooldown_s=600"
        )
        opened: list[object] = []
        recorder = Recorder()
        with caplog.at_level(logging.WARNING, "encdisagg.cache"):
            async with recorder.cache(settings, lambda s: opened.append(s)) as cache:
                assert not cache.connected
                assert cache.stats().connect_failures == 1
    assert opened == []
    assert "cannot connect to the master" in caplog.text
