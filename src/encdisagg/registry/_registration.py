"""``Registration``: one encoder's key under the registry prefix, bound to a lease.

The key holds the encoder's :class:`EncoderRecord`. A keeper task keeps the lease alive
(every third of its TTL) and rewrites the record when the load changed (every
``refresh_s``). If etcd is unreachable or the lease was lost (the encoder stalled past its
TTL), the keeper waits ``retry_s`` and registers afresh with a new lease: registration
resumes by itself once etcd is back. :meth:`Registration.withdraw` removes the key first,
for a drain; a process that dies simply stops renewing, and etcd deletes the key when the
lease runs out.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import anyio.lowlevel
import httpx

from .._errors import BadRequestError
from .._numbers import whole
from ..nurseries import collapse_single_error
from ._etcd import EtcdClient, RegistryUnavailableError
from ._record import EncoderLoad, EncoderRecord
from ._url import RegistryUrl, parse_registry_url

__all__ = ["Registration"]

_log = logging.getLogger("encdisagg.registry")

LoadSource = Callable[[], Awaitable[EncoderLoad]]


class Registration(anyio.AsyncContextManagerMixin):
    """Keeps ``record`` registered under ``registry`` for the ``async with`` block.

    Entering opens the etcd client and starts the keeper; it does not wait for etcd (an
    encoder serves whether or not the registry is up), so it is not a checkpoint beyond
    starting a task. Leaving withdraws (shielded, bounded by ``timeout_s`` per etcd call).

    :param registry: ``etcd://HOST:PORT/PREFIX`` (or a parsed :class:`RegistryUrl`).
    :param record: what to publish; its ``url`` names the key.
    :param load: called every ``refresh_s`` for the current load figures.
    :param lease_ttl_s: the lease's TTL: how long a dead encoder stays routable at most.
    :param refresh_s: how often the load is read (and the record rewritten if it changed).
    :param retry_s: pause before registering again after etcd failed or the lease was lost.
    :param timeout_s: bound on one etcd call.
    :param transport: an ``httpx`` transport for the etcd calls.
    """

    def __init__(
        self,
        registry: RegistryUrl | str,
        record: EncoderRecord,
        *,
        load: LoadSource | None = None,
        lease_ttl_s: int = 5,
        refresh_s: float = 2.0,
        retry_s: float = 1.0,
        timeout_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.registry = parse_registry_url(registry) if isinstance(registry, str) else registry
        whole("lease_ttl_s", lease_ttl_s, least=2, error=BadRequestError)
        self.record = record
        self._load = load
        self._ttl_s = lease_ttl_s
        self._refresh_s = refresh_s
        self._retry_s = retry_s
        self._timeout_s = timeout_s
        self._etcd = EtcdClient(self.registry, timeout_s=timeout_s, transport=transport)
        self._lease: int | None = None
        self._keeper: anyio.CancelScope | None = None
        self._withdrawn = False
        #: Set each time the record is (re)written with a fresh lease; for waiters.
        self._registered = anyio.Event()
        #: Registrations made (1 + how often it had to register again).
        self.registrations = 0

    @property
    def key(self) -> str:
        return self.registry.key(self.record.url)

    @property
    def registered(self) -> bool:
        """Whether the key is believed live (a lease is held and was renewed)."""
        return self._lease is not None

    async def wait_registered(self) -> None:
        """Wait until the record is registered (not bounded: use a deadline). A checkpoint."""
        await anyio.lowlevel.checkpoint()
        while not self.registered:
            await self._registered.wait()

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Registration]:
        # An error raised in the block leaves as itself, not in a group.
        with collapse_single_error():
            async with self._etcd, anyio.create_task_group() as group:
                await group.start(self._keep)
                try:
                    yield self
                finally:
                    await self.withdraw()
                    group.cancel_scope.cancel()

    async def withdraw(self) -> None:
        """Stop renewing, mark the record draining, delete the key, revoke the lease:
        routing stops first, and clients let the parts in flight here finish.

        A checkpoint; shielded and bounded (``timeout_s`` per etcd call), so it completes
        even if the caller is cancelled. A failure is logged: the lease then expires on its
        own within its TTL. Calling it again does nothing.
        """
        if self._withdrawn:
            await anyio.lowlevel.checkpoint()
            return
        self._withdrawn = True
        if self._keeper is not None:
            self._keeper.cancel()
        lease, self._lease = self._lease, None
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(3 * self._timeout_s):
                    if lease is not None:
                        # Said first, so clients let the parts in flight here finish.
                        draining = self.record.as_draining()
                        await self._etcd.put(self.key, draining.to_json(), lease=lease)
                    await self._etcd.delete(self.key)
                    if lease is not None:
                        await self._etcd.revoke(lease)
            except (RegistryUnavailableError, TimeoutError) as exc:
                _log.warning(
                    "could not withdraw %s from %s (its lease expires by itself): %s",
                    self.key,
                    self.registry,
                    exc,
                )
            else:
                _log.info("withdrew %s from %s", self.key, self.registry)
        await anyio.lowlevel.checkpoint_if_cancelled()

    # -- the keeper --------------------------------------------------------------------------

    async def _keep(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.CancelScope() as scope:
            self._keeper = scope
            task_status.started()
            failing = False
            while not self._withdrawn:
                try:
                    await self._register()
                    failing = False
                    await self._renew()
                except RegistryUnavailableError as exc:
                    if not failing:
                        _log.warning("registry %s unavailable, retrying: %s", self.registry, exc)
                    failing = True
                self._lease = None
                await anyio.sleep(self._retry_s)

    async def _register(self) -> None:
        await self._refresh_load()
        lease = await self._etcd.grant(self._ttl_s)
        await self._etcd.put(self.key, self.record.to_json(), lease=lease)
        if self._withdrawn:
            # Withdrawn while registering: the withdrawal may have missed this lease.
            await self._etcd.revoke(lease)
            return
        self._lease = lease
        self.registrations += 1
        self._registered.set()
        self._registered = anyio.Event()
        _log.info(
            "registered %s in %s (lease %x, ttl %d s)", self.key, self.registry, lease, self._ttl_s
        )

    async def _renew(self) -> None:
        """Renew the lease and refresh the load until the lease is lost (returns) or etcd
        fails (raises)."""
        lease = self._lease
        if lease is None:
            return
        now = anyio.current_time()
        next_renewal = now + self._ttl_s / 3
        next_refresh = now + self._refresh_s
        while True:
            await anyio.sleep_until(min(next_renewal, next_refresh))
            now = anyio.current_time()
            if now >= next_renewal:
                if await self._etcd.keepalive(lease) == 0:
                    _log.warning("lease of %s expired: registering again", self.key)
                    return
                next_renewal = now + self._ttl_s / 3
            if now >= next_refresh:
                before = self.record
                await self._refresh_load()
                if self.record != before:
                    await self._etcd.put(self.key, self.record.to_json(), lease=lease)
                next_refresh = now + self._refresh_s

    async def _refresh_load(self) -> None:
        if self._load is None:
            return
        try:
            load = await self._load()
        except Exception as exc:
            # The load is advisory: a failed read keeps the last figures.
            _log.debug("reading the load of %s failed: %s", self.record.url, exc)
            return
        self.record = self.record.with_load(load)
