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
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

from ..nurseries import ServiceTaskGroup, run_thread_to_completion
from ..transfer import payload_view
from ._breaker import BreakerState, CircuitBreaker
from ._entry import CachedItem, InvalidEntryError, entry_header, read_entry
from ._store import EmbeddingStore, open_mooncake_store
from ._url import GlobalCacheSettings

__all__ = ["GlobalCache", "GlobalCacheStats"]

logger = logging.getLogger("encdisagg.cache")

T = TypeVar("T")

#: How long opening the cache waits for its first connection attempt; later attempts run
#: in the background every ``cooldown_s``.
CONNECT_WAIT_S: Final = 10.0
#: Bound on the TCP reachability check made before each Mooncake setup (a setup against an
#: unreachable master blocks for minutes).
PROBE_TIMEOUT_S: Final = 2.0

_COUNTERS: Final = (
    "hits",
    "misses",
    "fallbacks",
    "skipped",
    "invalid",
    "lookup_failures",
    "fetch_failures",
    "inserts",
    "insert_failures",
    "inserts_dropped",
    "evictions",
    "eviction_failures",
    "connect_failures",
)


@dataclass(frozen=True, slots=True)
class GlobalCacheStats:
    """Counters of one :class:`GlobalCache` since it opened (items, unless said otherwise)."""

    #: Whether a store client is set up.
    connected: bool
    #: ``"closed"`` (in use), ``"open"`` (skipped) or ``"half_open"`` (probing).
    breaker: str
    #: How many times the breaker opened.
    breaker_opens: int
    #: Items served from the store.
    hits: int
    #: Items the store did not have.
    misses: int
    #: Items computed because a lookup or a fetch failed or was late.
    fallbacks: int
    #: Items not looked up: the breaker was open or the store not connected.
    skipped: int
    #: Entries found invalid (evicted and recomputed).
    invalid: int
    #: Lookup calls that failed or were late (each makes all its items fallbacks).
    lookup_failures: int
    #: Fetches that could not read some of the entries the lookup found.
    fetch_failures: int
    #: Entries stored.
    inserts: int
    #: Inserts the store failed.
    insert_failures: int
    #: Inserts not attempted: breaker not closed, not connected, or too many pending.
    inserts_dropped: int
    #: Invalid entries removed from the store.
    evictions: int
    #: Removals the store failed.
    eviction_failures: int
    #: Failed attempts to set up the store client.
    connect_failures: int
    #: Inserts and evictions waiting or running now.
    pending: int


class _NoAnswer(Exception):
    """A store call failed, or did not answer in time."""


@dataclass(eq=False)
class _Answer(Generic[T]):
    """The result box of one store call; written by its task, read by the waiting request."""

    done: anyio.Event = field(default_factory=anyio.Event)
    #: ``(value,)`` once the call returned.
    value: tuple[T] | None = None
    error: Exception | None = None
    #: False once the request stopped waiting (timed out): the answer is then dropped.
    waited_for: bool = True


@dataclass(eq=False)
class _LookupReport:
    """What one lookup found, per key (built in the worker thread)."""

    found: dict[str, CachedItem] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    invalid: dict[str, str] = field(default_factory=dict)
    fetch_error: Exception | None = None


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
        self._open_store = open_store
        self._on_event = on_event
        self._on_breaker = on_breaker
        self._close_timeout_s = close_timeout_s
        self._breaker = CircuitBreaker(
            threshold=settings.failures,
            cooldown_s=settings.cooldown_s,
            clock=clock or anyio.current_time,
        )
        self._lookup_limiter = anyio.CapacityLimiter(lookup_threads)
        self._background_limiter = anyio.CapacityLimiter(background_threads)
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._group: ServiceTaskGroup | None = None
        # Set by the worker thread that set the client up (so a cancellation delivered
        # after the setup returned cannot lose it); cleared, and closed, at exit.
        self._store: EmbeddingStore | None = None
        self._first_attempt = anyio.Event()
        # Inserts and evictions waiting or running; `_idle` is set whenever it is 0.
        self._pending = 0
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
                group.start_soon(self._connect, name="global cache connect")
                with anyio.move_on_after(CONNECT_WAIT_S):
                    await self._first_attempt.wait()
                try:
                    yield self
                finally:
                    # Nothing new starts; tasks in flight end with the group (store calls
                    # already in a worker thread finish first).
                    self._group = None
        finally:
            await self._close_store()

    async def _close_store(self) -> None:
        store, self._store = self._store, None
        if store is None:
            return
        with anyio.move_on_after(self._close_timeout_s, shield=True) as scope:
            # Abandoning this one call on timeout is safe: the client holds no encoder memory
            # (no registration, no pointer), so a close that outlives the bound only keeps
            # its own resources a little longer. Against a dead master it can take many
            # seconds, and shutdown should not wait for that.
            await anyio.to_thread.run_sync(store.close, abandon_on_cancel=True)
        if scope.cancelled_caught:
            logger.warning(
                "closing the global cache's store client took over %s s; left it closing",
                self._close_timeout_s,
            )

    async def _connect(self) -> None:
        try:
            while not await self._try_connect():
                self._first_attempt.set()
                await anyio.sleep(self.settings.cooldown_s)
        finally:
            self._first_attempt.set()

    async def _try_connect(self) -> bool:
        problem = await self._probe()
        if problem is None:
            try:
                await run_thread_to_completion(self._open_sync)
            except Exception as exc:
                problem = str(exc) or repr(exc)
        if problem is not None:
            self._count("connect_failures", 1)
            logger.warning(
                "global cache at %s is unavailable (%s); computing every item, retrying in %s s",
                self.settings.master,
                problem,
                self.settings.cooldown_s,
            )
            return False
        logger.info("global cache connected to master %s", self.settings.master)
        return True

    def _open_sync(self) -> None:
        # Runs in a worker thread and records the client itself (see __init__).
        self._store = self._open_store(self.settings)

    async def _probe(self) -> str | None:
        """Why the master or metadata server cannot be reached, or None."""
        targets = [(self.settings.master_host, self.settings.master_port, "master")]
        metadata = urllib.parse.urlsplit(self.settings.metadata)
        if metadata.scheme in ("http", "https") and metadata.hostname:
            port = metadata.port or (443 if metadata.scheme == "https" else 80)
            targets.append((metadata.hostname, port, "metadata server"))
        for host, port, what in targets:
            try:
                with anyio.fail_after(PROBE_TIMEOUT_S):
                    stream = await anyio.connect_tcp(host, port)
                await stream.aclose()
            except (OSError, TimeoutError) as exc:
                return f"cannot connect to the {what} at {host}:{port}: {exc or 'timed out'}"
        return None

    # -- introspection -------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._store is not None

    @property
    def breaker_state(self) -> BreakerState:
        return self._breaker.state

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
            self._on_event(_EVENT_NAMES[counter], n)

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
        store = self._store
        if store is None or self._group is None:
            return None
        allowed, changed = self._breaker.allow()
        self._report(changed)
        return store if allowed else None

    def _settle_lookup(self, report: _LookupReport) -> dict[str, CachedItem]:
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

    def _lookup_failed(self, keys: Sequence[str], exc: _NoAnswer) -> None:
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
        try:
            report = await self._ask(self._lookup_sync, store, wanted)
        except _NoAnswer as exc:
            self._lookup_failed(wanted, exc)
            return {}
        return self._settle_lookup(report)

    def _lookup_sync(self, store: EmbeddingStore, keys: list[str]) -> _LookupReport:
        # Runs in a worker thread: existence first, then one batched read of the hits.
        report = _LookupReport()
        present = store.exists(keys)
        hits = [key for key, there in zip(keys, present, strict=True) if there]
        report.absent = [key for key, there in zip(keys, present, strict=True) if not there]
        if not hits:
            return report
        try:
            values = store.fetch(hits)
        except Exception as exc:
            report.fetch_error = exc
            report.failed = hits
            return report
        for key, raw in zip(hits, values, strict=True):
            if raw is None:
                report.failed.append(key)
                continue
            try:
                report.found[key] = read_entry(raw, hidden=self._hidden_size, dtype=self._dtype)
            except InvalidEntryError as exc:
                report.invalid[key] = str(exc)
        return report

    async def _ask(self, func: Callable[..., T], *args: object) -> T:
        """Run ``func(*args)`` in a worker thread as a task of the cache; wait for its answer
        at most ``timeout_ms``. The call itself is never abandoned.

        :raises _NoAnswer: if it raised, or did not answer in time.
        """
        group = self._group
        if group is None:
            raise _NoAnswer("the cache is closing")
        answer: _Answer[T] = _Answer()
        group.start_soon(self._answer, answer, func, args, name="global cache lookup")
        with anyio.move_on_after(self.settings.timeout_s):
            await answer.done.wait()
        if not answer.done.is_set():
            answer.waited_for = False
            raise _NoAnswer(f"no answer within {self.settings.timeout_ms} ms")
        if answer.value is None:
            error = answer.error
            raise _NoAnswer((str(error) or repr(error)) if error else "no answer") from error
        return answer.value[0]

    async def _answer(
        self, answer: _Answer[T], func: Callable[..., T], args: tuple[object, ...]
    ) -> None:
        try:
            answer.value = (
                await run_thread_to_completion(func, *args, limiter=self._lookup_limiter),
            )
        except Exception as exc:
            answer.error = exc
            if not answer.waited_for:
                logger.info("a late global cache lookup failed too: %s", exc)
        finally:
            answer.done.set()

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
        store = self._store
        group = self._group
        if (
            store is None
            or group is None
            or not self._breaker.closed
            or self._pending >= self.settings.max_pending_inserts
        ):
            self._count("inserts_dropped", 1)
            return False
        self._start(group, self._insert, store, key, item, name="global cache insert")
        return True

    def evict_soon(self, key: str) -> None:
        """Remove ``key`` from the store in the background. Not a checkpoint; never raises."""
        store = self._store
        group = self._group
        if store is None or group is None:
            return
        self._start(group, self._evict, store, key, name="global cache eviction")

    def _start(
        self,
        group: ServiceTaskGroup,
        func: Callable[..., Awaitable[None]],
        *args: object,
        name: str,
    ) -> None:
        if self._pending == 0:
            self._idle = anyio.Event()
        self._pending += 1
        group.start_soon(self._background, func, *args, name=name)

    async def _background(self, func: Callable[..., Awaitable[None]], *args: object) -> None:
        try:
            await func(*args)
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    async def _insert(self, store: EmbeddingStore, key: str, item: CachedItem) -> None:
        try:
            await run_thread_to_completion(
                self._put_sync, store, key, item, limiter=self._background_limiter
            )
        except Exception as exc:
            self._count("insert_failures", 1)
            logger.warning("global cache insert of %s failed: %s", key, exc)
            self._record(False)
        else:
            self._count("inserts", 1)
            self._record(True)

    def _put_sync(self, store: EmbeddingStore, key: str, item: CachedItem) -> None:
        # Runs in a worker thread. The payload view references `rows`, which keeps the
        # memory alive for as long as the store reads it.
        rows = item.rows.detach()
        if rows.device.type != "cpu":
            rows = rows.to("cpu")
        rows = rows.contiguous()
        header = entry_header(item.tokens, self._hidden_size, self._dtype, item.grid)
        store.put(key, header, payload_view(rows))

    async def _evict(self, store: EmbeddingStore, key: str) -> None:
        try:
            await run_thread_to_completion(store.remove, key, limiter=self._background_limiter)
        except Exception as exc:
            self._count("eviction_failures", 1)
            logger.warning("global cache eviction of %s failed: %s", key, exc)
            self._record(False)
        else:
            self._count("evictions", 1)


_EVENT_NAMES: Final = {
    "hits": "hit",
    "misses": "miss",
    "fallbacks": "fallback",
    "skipped": "skipped",
    "invalid": "invalid",
    "lookup_failures": "lookup_failure",
    "fetch_failures": "fetch_failure",
    "inserts": "insert",
    "insert_failures": "insert_failure",
    "inserts_dropped": "insert_dropped",
    "evictions": "eviction",
    "eviction_failures": "eviction_failure",
    "connect_failures": "connect_failure",
}
