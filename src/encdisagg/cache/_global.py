"""The global tier: embeddings shared by every encoder that points at one Mooncake Store.

Ownership: a :class:`GlobalCache` owns one task group. Every store call runs in a worker
thread inside a task of that group (never abandoned), so each call ends before the cache
closes. A request waits for its lookup at most ``timeout_ms``; if the answer is late, the
request computes its items itself and the call finishes on its own inside the group.
That is safe because the store never gets pointers into encoder memory (see ``_store``).

Failure policy: the cache never fails a request. A lookup that fails or is late makes all
its items misses; an entry that cannot be read is recomputed; an invalid entry is evicted
and recomputed; a failed insert is logged and counted. After ``failures`` consecutive store
failures a circuit breaker skips the tier for ``cooldown_s``, then lets one lookup probe it.

This module holds that policy; the calls into the store live in ``_store_io`` and the store
client's set-up and close in ``_connect``.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Final

import anyio
import anyio.lowlevel
import torch

from ..nurseries import ServiceTaskGroup, run_thread_to_completion
from ._breaker import BreakerState, CircuitBreaker
from ._connect import StoreConnection
from ._entry import CachedItem
from ._stats import COUNTERS, EVENT_NAMES, GlobalCacheStats
from ._store import EmbeddingStore, open_mooncake_store
from ._store_io import LookupReport, NoAnswer, ask_bounded, lookup_entries, put_entry
from ._store_url import GlobalCacheSettings

__all__ = ["GlobalCache"]

logger = logging.getLogger("encdisagg.cache")

#: How long opening the cache waits for its first connection attempt; later attempts run
#: in the background every ``cooldown_s``.
CONNECT_WAIT_S: Final = 10.0


class GlobalCache(anyio.AsyncContextManagerMixin):
    """The global embedding tier over an :class:`EmbeddingStore` (Mooncake Store).

    ``async with GlobalCache(settings, hidden_size=..., dtype=...) as cache`` starts
    connecting (waiting up to 10 s for the first attempt; an unreachable store is retried
    every ``cooldown_s`` in the background, and the tier is skipped meanwhile). Leaving the
    block cancels inserts that have not started, waits for store calls in flight, and
    closes the store client (bounded by ``close_timeout_s``).

    :param settings: from :func:`~encdisagg.cache.parse_global_cache_url`.
    :param hidden_size: the model's embedding width; entries of another width are invalid.
    :param dtype: the model's embedding dtype; entries of another dtype are invalid.
    :param open_store: builds the store client (blocking); the Mooncake Store by default.
    :param clock: the breaker's clock (default: the event loop's, ``anyio.current_time``).
    :param on_event: called with ``(event, count)`` for every counter change, e.g.
        ``("hit", 3)``; the events are the counter names of :class:`GlobalCacheStats` in
        the singular (``hit``, ``miss``, ``fallback``, ``skipped``, ``invalid``,
        ``lookup_failure``, ``fetch_failure``, ``insert``, ``insert_failure``,
        ``insert_dropped``, ``eviction``, ``eviction_failure``, ``connect_failure``).
    :param on_breaker: called with the breaker's new state (``"open"``…) on each change.
    :param lookup_threads: store calls of requests (lookups) that may run at once.
    :param background_threads: inserts and evictions that may run at once.
    :param close_timeout_s: bound on closing the store client at exit.
    """

    def __init__(
        self,
        settings: GlobalCacheSettings,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        open_store: Callable[[GlobalCacheSettings], EmbeddingStore] = open_mooncake_store,
        clock: Callable[[], float] | None = None,
        on_event: Callable[[str, int], None] | None = None,
        on_breaker: Callable[[str], None] | None = None,
        lookup_threads: int = 4,
        background_threads: int = 2,
        close_timeout_s: float = 10.0,
    ) -> None:
        self.settings = settings
        self._hidden_size = hidden_size
        self._dtype = dtype
        self._on_event = on_event
        self._on_breaker = on_breaker
        self._breaker = CircuitBreaker(
            threshold=settings.failures,
            cooldown_s=settings.cooldown_s,
            clock=clock or anyio.current_time,
        )
        self._lookup_limiter = anyio.CapacityLimiter(lookup_threads)
        self._background_limiter = anyio.CapacityLimiter(background_threads)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._group: ServiceTaskGroup | None = None
        self._connection = StoreConnection(
            settings,
            open_store,
            on_failure=functools.partial(self._count, "connect_failures", 1),
            close_timeout_s=close_timeout_s,
        )
        # Inserts and evictions waiting or running; `_idle` is set whenever it is 0.
        self._pending = 0
        # Per key, the event the newest insert or eviction of it sets when it ended: the next
        # one of that key waits for it, so the store sees them in the order they were asked.
        self._last_by_key: dict[str, anyio.Event] = {}
        self._idle = anyio.Event()
        self._idle.set()
        self._entered = False

    # -- lifecycle ---------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[GlobalCache]:
        if self._entered:
            raise RuntimeError("a GlobalCache can be opened only once")
        self._entered = True
        try:
            async with ServiceTaskGroup("global embedding cache", logger=logger) as group:
                self._group = group
                group.start_soon(self._connection.run, name="global cache connect")
                with anyio.move_on_after(CONNECT_WAIT_S):
                    await self._connection.first_attempt.wait()
                try:
                    yield self
                finally:
                    # Nothing new starts; tasks in flight end with the group (store calls
                    # already in a worker thread finish first).
                    self._group = None
        finally:
            await self._connection.aclose()

    # -- introspection -------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connection.store is not None

    def stats(self) -> GlobalCacheStats:
        """A snapshot of the counters. Not a checkpoint."""
        return GlobalCacheStats(
            connected=self.connected,
            breaker=self._breaker.state.value,
            breaker_opens=self._breaker.opens,
            pending=self._pending,
            **self._counts,
        )

    async def drain(self) -> None:
        """Wait until no insert or eviction is waiting or running. A checkpoint."""
        await anyio.lowlevel.checkpoint()
        while self._pending:
            await self._idle.wait()

    # -- synchronous decisions ----------------------------------------------------------------

    def _count(self, counter: str, n: int) -> None:
        if n <= 0:
            return
        self._counts[counter] += n
        if self._on_event is not None:
            self._on_event(EVENT_NAMES[counter], n)

    def _report(self, changed: BreakerState | None) -> None:
        if changed is None:
            return
        level = logging.WARNING if changed is BreakerState.OPEN else logging.INFO
        logger.log(
            level,
            "global cache breaker is now %s%s",
            changed.value,
            f" for {self.settings.cooldown_s} s" if changed is BreakerState.OPEN else "",
        )
        if self._on_breaker is not None:
            self._on_breaker(changed.value)

    def _record(self, ok: bool) -> None:
        self._report(self._breaker.record_success() if ok else self._breaker.record_failure())

    def _usable(self) -> EmbeddingStore | None:
        store = self._connection.store
        if store is None or self._group is None:
            return None
        allowed, changed = self._breaker.allow()
        self._report(changed)
        return store if allowed else None

    def _settle_lookup(self, report: LookupReport) -> dict[str, CachedItem]:
        self._count("hits", len(report.found))
        self._count("misses", len(report.absent))
        self._count("fallbacks", len(report.failed))
        if report.failed:
            self._count("fetch_failures", 1)
            logger.warning(
                "global cache could not read %d entr%s (%s); computing them",
                len(report.failed),
                "y" if len(report.failed) == 1 else "ies",
                report.fetch_error or "gone since the lookup",
            )
        for key, reason in report.invalid.items():
            logger.warning("global cache entry %s is invalid (%s); evicting it", key, reason)
            self.evict_soon(key)
        self._count("invalid", len(report.invalid))
        fetched = len(report.found) + len(report.failed) + len(report.invalid)
        self._record(report.fetch_error is None and not (fetched and len(report.failed) == fetched))
        return report.found

    def _lookup_failed(self, keys: Sequence[str], exc: NoAnswer) -> None:
        self._count("lookup_failures", 1)
        self._count("fallbacks", len(keys))
        logger.warning(
            "global cache lookup of %d item(s) failed (%s); computing them", len(keys), exc
        )
        self._record(False)

    # -- lookups --------------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[str]) -> dict[str, CachedItem]:
        """The valid entries stored under ``keys`` (duplicates looked up once).

        A checkpoint. Waits at most ``timeout_ms`` for the store. Never raises but for
        cancellation: a failed or late lookup returns ``{}`` (all misses); entries that
        cannot be read are left out (computed by the caller); invalid ones are left out and
        evicted in the background. The returned rows are fresh memory, shared with nobody.
        """
        await anyio.lowlevel.checkpoint()
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        store = self._usable()
        if store is None:
            self._count("skipped", len(wanted))
            return {}
        lookup = functools.partial(lookup_entries, hidden_size=self._hidden_size, dtype=self._dtype)
        try:
            report = await ask_bounded(
                self._group,
                lookup,
                store,
                wanted,
                limiter=self._lookup_limiter,
                timeout_ms=self.settings.timeout_ms,
            )
        except NoAnswer as exc:
            self._lookup_failed(wanted, exc)
            return {}
        return self._settle_lookup(report)

    # -- inserts and evictions ------------------------------------------------------------------

    def insert_soon(self, key: str, item: CachedItem) -> bool:
        """Store ``item`` under ``key`` in the background. Not a checkpoint; never raises.

        Returns whether the insert was started: it is dropped (and counted) if the breaker is
        not closed, the store is not connected, too many inserts are pending, or the item is
        not a valid ``[tokens, hidden]`` embedding of the model's dtype (never cached).
        """
        rows = item.rows
        if (
            rows.dim() != 2
            or tuple(rows.shape) != (item.tokens, self._hidden_size)
            or rows.dtype != self._dtype
        ):
            logger.error(
                "not caching %s: rows %s %s do not match %d tokens x %d %s",
                key,
                tuple(rows.shape),
                rows.dtype,
                item.tokens,
                self._hidden_size,
                self._dtype,
            )
            self._count("inserts_dropped", 1)
            return False
        put = functools.partial(
            put_entry, key=key, item=item, hidden_size=self._hidden_size, dtype=self._dtype
        )
        started = (
            self._breaker.closed
            and self._pending < self.settings.max_pending_inserts
            and self._start("insert", key, put)
        )
        if not started:
            self._count("inserts_dropped", 1)
        return started

    def evict_soon(self, key: str) -> None:
        """Remove ``key`` from the store in the background. Not a checkpoint; never raises."""
        self._start("eviction", key, operator.methodcaller("remove", key))

    def _start(self, what: str, key: str, call: Callable[[EmbeddingStore], object]) -> bool:
        """Run ``call(store)`` in the background (see :meth:`_background`); ``False`` when
        the store is not connected or the cache is closing."""
        store, group = self._connection.store, self._group
        if store is None or group is None:
            return False
        if self._pending == 0:
            self._idle = anyio.Event()
        self._pending += 1
        # In order per key: with two background threads, the eviction of an invalid entry
        # could otherwise run during or after the insert of its recomputed rows and take
        # the fresh entry with it.
        before = self._last_by_key.get(key)
        ended = self._last_by_key[key] = anyio.Event()
        group.start_soon(
            self._background, what, key, before, ended, call, store, name=f"global cache {what}"
        )
        return True

    async def _background(
        self,
        what: str,
        key: str,
        before: anyio.Event | None,
        ended: anyio.Event,
        func: Callable[..., object],
        *args: object,
    ) -> None:
        """One insert or eviction (``what``) in a worker thread, once the one before it of
        ``key`` ended: counted, and fed to the breaker. An eviction runs whatever the breaker
        says, so its success does not close the breaker; only its failure counts."""
        try:
            if before is not None:
                await before.wait()
            await run_thread_to_completion(func, *args, limiter=self._background_limiter)
        except Exception as exc:
            self._count(f"{what}_failures", 1)
            logger.warning("global cache %s of %s failed: %s", what, key, exc)
            self._record(False)
        else:
            self._count(f"{what}s", 1)
            if what == "insert":
                self._record(True)
        finally:
            ended.set()
            if self._last_by_key.get(key) is ended:
                del self._last_by_key[key]
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()
