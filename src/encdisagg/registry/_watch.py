"""The live view of a fleet: a synchronous table of records, kept current by one watch.

:class:`RegistryView` is the table (decisions, no I/O). :class:`RegistryWatcher` reads the
prefix once, then follows one etcd watch from the next revision: every join, load refresh
and leave arrives as an event, with no polling per request. When etcd goes away the view
keeps its last contents (``connected`` turns false) and the watcher reads and watches
afresh once etcd answers again; a watch whose revision was compacted reads afresh too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Iterable, Sequence
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import anyio.lowlevel
import httpx

from .._errors import BadRequestError
from ..nurseries import collapse_single_error
from ._etcd import EtcdClient, KeyValue, RegistryUnavailableError, WatchCompactedError, WatchEvent
from ._record import EncoderRecord
from ._url import RegistryUrl, parse_registry_url

__all__ = ["RegistryView", "RegistryWatcher"]

_log = logging.getLogger("encdisagg.registry")


class RegistryView:
    """The encoders registered under one prefix, as last seen. Synchronous throughout.

    :ivar revision: the etcd revision the view reflects.
    :ivar connected: whether the watch is live (false: the view is the last one seen).
    :ivar malformed: records skipped because they did not decode.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._records: dict[str, EncoderRecord] = {}
        self.revision = 0
        self.connected = False
        self.malformed = 0
        #: When (``anyio.current_time()``) each encoder last left the view.
        self.left_at: dict[str, float] = {}
        #: Encoders whose last record before they left said they were draining.
        self.drained: set[str] = set()
        self._changed = anyio.Event()

    @property
    def records(self) -> dict[str, EncoderRecord]:
        """URL -> record of every encoder in the view (a copy)."""
        return dict(self._records)

    def __contains__(self, url: object) -> bool:
        return url in self._records

    def __len__(self) -> int:
        return len(self._records)

    def get(self, url: str) -> EncoderRecord | None:
        return self._records.get(url)

    def _name(self, key: str) -> str | None:
        return key[len(self.prefix) :] if key.startswith(self.prefix) else None

    def _decode(self, key: str, raw: bytes) -> EncoderRecord | None:
        try:
            record = EncoderRecord.from_json(raw)
        except BadRequestError as exc:
            self.malformed += 1
            _log.warning("skipping the registry record %r: %s", key, exc.message)
            return None
        if self._name(key) != record.url:
            self.malformed += 1
            _log.warning("skipping the registry record %r: it names %r", key, record.url)
            return None
        return record

    def reset(self, revision: int, entries: Iterable[KeyValue], now: float) -> None:
        """Replace the view with a full read of the prefix at ``revision``."""
        fresh: dict[str, EncoderRecord] = {}
        for entry in entries:
            record = self._decode(entry.key, entry.value)
            if record is not None:
                fresh[record.url] = record
        for url in self._records.keys() - fresh.keys():
            self._left(url, now)
        for url in fresh.keys() - self._records.keys():
            self.drained.discard(url)  # back in the view
        self._records = fresh
        self.revision = revision
        self._wake()

    def apply(self, events: Sequence[WatchEvent], now: float) -> None:
        """Apply one batch of watch events (in revision order)."""
        for event in events:
            if event.revision <= self.revision:
                continue  # already in the view (a read overlapping the watch)
            self.revision = event.revision
            name = self._name(event.key)
            if name is None:
                continue
            record = None if event.kind == "delete" else self._decode(event.key, event.value)
            if record is None:
                if name in self._records:
                    self._left(name, now)
                    del self._records[name]
                continue
            if name not in self._records:
                self.drained.discard(name)  # back in the view
            self._records[name] = record
        self._wake()

    def _left(self, url: str, now: float) -> None:
        self.left_at[url] = now
        if self._records[url].draining:
            self.drained.add(url)

    def set_connected(self, connected: bool) -> None:
        if connected != self.connected:
            self.connected = connected
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_changed(self) -> None:
        """Wait for the next change (a join, leave, load refresh or connection change).

        A checkpoint; not bounded: use a deadline.
        """
        await self._changed.wait()


class RegistryWatcher(anyio.AsyncContextManagerMixin):
    """Keeps a :class:`RegistryView` of ``registry`` current for the ``async with`` block.

    Entering starts the watch task and returns at once (not waiting for etcd); call
    :meth:`wait_synced` to wait for the first read. Leaving cancels the watch.

    :param retry_s: pause before reading again after etcd failed.
    :param timeout_s: bound on one etcd call (the watch stream itself is unbounded).
    """

    def __init__(
        self,
        registry: RegistryUrl | str,
        *,
        retry_s: float = 0.5,
        timeout_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.registry = parse_registry_url(registry) if isinstance(registry, str) else registry
        self.view = RegistryView(self.registry.prefix)
        self._retry_s = retry_s
        self._etcd = EtcdClient(self.registry, timeout_s=timeout_s, transport=transport)
        self._synced = anyio.Event()

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[RegistryWatcher]:
        # An error raised in the block leaves as itself, not in a group.
        with collapse_single_error():
            async with self._etcd, anyio.create_task_group() as group:
                group.start_soon(self._follow)
                try:
                    yield self
                finally:
                    group.cancel_scope.cancel()

    async def wait_synced(self) -> None:
        """Wait for the first full read of the prefix. A checkpoint; not bounded."""
        await self._synced.wait()

    async def _follow(self) -> None:
        view = self.view
        failing = False
        while True:
            try:
                revision, entries = await self._etcd.get_prefix(self.registry.prefix)
                view.reset(revision, entries, anyio.current_time())
                self._synced.set()
                failing = False
                await self._etcd.watch_prefix(
                    self.registry.prefix,
                    revision + 1,
                    lambda events: view.apply(events, anyio.current_time()),
                    on_created=lambda: view.set_connected(True),
                )
            except WatchCompactedError as exc:
                _log.info("registry watch compacted (%s): reading again", exc)
                continue
            except RegistryUnavailableError as exc:
                if not failing:
                    _log.warning(
                        "registry %s unavailable; routing on the last view: %s",
                        self.registry,
                        exc,
                    )
                failing = True
            view.set_connected(False)
            await anyio.sleep(self._retry_s)
