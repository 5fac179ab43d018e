"""The global tier's store client: set up in the background, retried, closed at exit.

Setting up a Mooncake client against an unreachable master blocks for minutes, so every
attempt first checks (bounded) that the master and the metadata server accept TCP
connections. The client is recorded by the worker thread that set it up, so a cancellation
delivered after the setup returned cannot lose it.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import anyio

from ..nurseries import run_thread_to_completion
from ..transfer._lifetime import close_in_thread

if TYPE_CHECKING:
    from ._store import EmbeddingStore
    from ._store_url import GlobalCacheSettings

__all__ = ["StoreConnection"]

logger = logging.getLogger("encdisagg.cache")

#: Bound on the TCP reachability check made before each Mooncake setup (a setup against an
#: unreachable master blocks for minutes).
PROBE_TIMEOUT_S: Final = 2.0


class StoreConnection:
    """Owns the store client of one :class:`~encdisagg.cache.GlobalCache`.

    :param open_store: builds the store client (blocking).
    :param on_failure: called (synchronously) after each failed attempt.
    :param close_timeout_s: bound on closing the client.
    """

    def __init__(
        self,
        settings: GlobalCacheSettings,
        open_store: Callable[[GlobalCacheSettings], EmbeddingStore],
        *,
        on_failure: Callable[[], None],
        close_timeout_s: float,
    ) -> None:
        self.settings = settings
        self._open_store = open_store
        self._on_failure = on_failure
        self._close_timeout_s = close_timeout_s
        #: The client once set up; ``None`` before, and again after :meth:`aclose`.
        self.store: EmbeddingStore | None = None
        #: Set once the first attempt ended, whatever its outcome.
        self.first_attempt = anyio.Event()

    async def run(self) -> None:
        """Try to set the client up until it is, every ``cooldown_s``. A task of the cache."""
        try:
            while not await self._try_connect():
                self.first_attempt.set()
                await anyio.sleep(self.settings.cooldown_s)
        finally:
            self.first_attempt.set()

    async def _try_connect(self) -> bool:
        problem = await self._probe()
        if problem is None:
            try:
                await run_thread_to_completion(self._open_sync)
            except Exception as exc:
                problem = str(exc) or repr(exc)
        if problem is not None:
            self._on_failure()
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
        # Runs in a worker thread and records the client itself (see the module docstring).
        self.store = self._open_store(self.settings)

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

    async def aclose(self) -> None:
        """Close the client, if one was set up; shielded, bounded by ``close_timeout_s``."""
        store, self.store = self.store, None
        if store is None:
            return
        # Abandoning this one call on timeout is safe: the client holds no encoder memory
        # (no registration, no pointer), so a close that outlives the bound only keeps
        # its own resources a little longer. Against a dead master it can take many
        # seconds, and shutdown should not wait for that.
        if not await close_in_thread(store.close, self._close_timeout_s):
            logger.warning(
                "closing the global cache's store client took over %s s; left it closing",
                self._close_timeout_s,
            )
