"""``encdisagg serve --registry``: the server's own entry in the fleet registry.

Registration starts once the server serves (its URL is known and its lifespan started) and
publishes the Encoder's figures every ``registry_refresh_s``. On a graceful shutdown the
key is removed *first* — clients stop routing to this encoder — and only then does
Hypercorn stop accepting and let the requests in flight finish. A killed server leaves its
key to its lease, which etcd ends within ``registry_lease_ttl_s``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from ..._config import EncoderConfig
from ..._modality import Modality
from ...registry import EncoderLoad, EncoderRecord, Registration
from .._service import EncoderService
from .._settings import ServerSettings

__all__ = ["ServerRegistration"]

_log = logging.getLogger("encdisagg.server")

_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def _advertised(url: str) -> str:
    """``url`` as other hosts reach it: a wildcard bind advertises the host's name."""
    scheme, _, rest = url.partition("://")
    host, _, port = rest.rpartition(":")
    if host in _WILDCARD_HOSTS:
        return f"{scheme}://{socket.gethostname()}:{port}"
    return url


def _modalities(config: EncoderConfig) -> tuple[Modality, ...]:
    # The null model takes anything; the Qwen2-VL family encodes images and videos.
    if config.model == "null":
        return tuple(Modality)
    from ...models._loading import is_audio_model

    if is_audio_model(config.model):  # Qwen2-Audio / Qwen2.5-Omni encoders: audio alone
        return (Modality.AUDIO,)
    return (Modality.IMAGE, Modality.VIDEO)


class ServerRegistration(anyio.AsyncContextManagerMixin):
    """Registers a served app under ``settings.registry`` (nothing happens without one).

    Use :meth:`on_serving` as (or inside) the server's ``on_serving`` callback and
    :meth:`drain_after` around its shutdown trigger.
    """

    def __init__(
        self, settings: ServerSettings, config: EncoderConfig, service: EncoderService
    ) -> None:
        self._settings = settings
        self._config = config
        self._service = service
        self._url: str | None = None
        self._serving = anyio.Event()
        self._registration: Registration | None = None
        self._withdrawn = anyio.Event()

    def on_serving(self, url: str) -> None:
        """The server serves at ``url``: register it. Not async."""
        self._url = _advertised(url)
        self._serving.set()

    async def drain_after(self, trigger: Callable[[], Awaitable[Any]]) -> None:
        """Wait for ``trigger``, then withdraw the key; the server's drain follows.

        A checkpoint; the withdrawal is shielded and bounded (see
        :meth:`~encdisagg.registry.Registration.withdraw`).
        """
        await trigger()
        if self._registration is not None:
            await self._registration.withdraw()
        self._withdrawn.set()

    async def _load(self) -> EncoderLoad:
        gauges = (await self._service.require_backend().snapshot()).encoder.gauges
        return EncoderLoad(
            queue_depth=int(gauges.get("live_requests", 0)),
            staged_bytes=int(gauges.get("staged_bytes", 0)),
        )

    async def _register(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        await self._serving.wait()
        assert self._url is not None
        assert self._settings.registry is not None
        config = self._config
        record = EncoderRecord(
            url=self._url,
            model=config.model,
            modalities=_modalities(config),
            transfers=(config.transfer,),
            capacity=config.max_batch_size * self._settings.dp,
        )
        registration = Registration(
            self._settings.registry,
            record,
            load=self._load,
            lease_ttl_s=self._settings.registry_lease_ttl_s,
            refresh_s=self._settings.registry_refresh_s,
        )
        async with registration:
            self._registration = registration
            _log.info("registering %s under %s", self._url, registration.registry)
            await self._withdrawn.wait()

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[ServerRegistration]:
        if self._settings.registry is None:
            yield self
            return
        # In the serve process every httpx call is a registry call: an INFO line per lease
        # renewal would repeat every second or two.
        httpx_log = logging.getLogger("httpx")
        httpx_log.setLevel(max(logging.WARNING, httpx_log.getEffectiveLevel()))
        async with anyio.create_task_group() as group:
            await group.start(self._register)
            try:
                yield self
            finally:
                # Withdraws (shielded, bounded) if the drain did not already.
                self._withdrawn.set()
