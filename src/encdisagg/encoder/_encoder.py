"""The Encoder: the public face of the request lifecycle (ownership: docs/architecture.md).

This module wires the rooms together and carries the public contract: ``_table`` decides
what a request may do, ``_lifecycle`` runs its jobs, ``_compute/`` and ``_delivery`` do the
work, ``_staging/_owner`` owns the memory and every engine registration.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import anyio.lowlevel

from .._config import EncoderConfig
from .._errors import BadRequestError, ServiceUnavailableError
from ..cache import GlobalCache, GlobalCacheStats
from ..models import ModelOptions, VisionModel
from ..nurseries import ServiceTaskGroup, collapse_single_error
from ..transfer import TransferEngine, ZmqPushPool
from ._compute._batcher import Batcher
from ._compute._cache import PrefixCache
from ._compute._path import ComputePath
from ._delivery import Delivery
from ._events import EncoderEvents
from ._lifecycle import RequestLifecycle
from ._parts import global_cache_settings, load_configured_model, open_engine, open_global_cache
from ._shutdown import drain
from ._staging._budget import StagedBudget
from ._staging._owner import RegionOwner
from ._types import (
    Destination,
    EncodeRequest,
    EncodeResult,
    EncoderStats,
    MooncakeDestination,
    ZmqDestination,
)

__all__ = ["Encoder", "EncoderEvents"]

_MIB = 1024 * 1024
#: Messages queued per receiver before pushes wait for room. Copied (small) messages cost
#: their size each; zero-copy ones are waited for anyway. ZMQ's own default is 1000.
_ZMQ_QUEUE = 256


class Encoder(anyio.AsyncContextManagerMixin):
    """An encoder service embedded in the caller's process.

    Constructing does nothing. ``async with Encoder(config) as encoder`` loads the model
    (unless one is given), starts the transfer engine the config asks for (unless one is
    given), registers the staging arena, and starts the batcher. Leaving the block releases
    every live request, waits (up to ``config.shutdown_grace_s``) for every transfer, and
    deregisters everything (bounded by ``config.cleanup_timeout_s``). An exception raised in
    the block propagates as itself, never wrapped in an ``ExceptionGroup``.

    :param config: the configuration (defaults: the embedded ``"tiny"`` model, ZMQ).
    :param model: a ready :class:`~encdisagg.models.VisionModel` instead of ``config.model``.
    :param engine: a ready transfer engine instead of the one ``config.transfer`` names.
    :param events: optional callbacks for metrics.
    """

    def __init__(
        self,
        config: EncoderConfig | None = None,
        *,
        model: VisionModel | None = None,
        engine: TransferEngine | None = None,
        events: EncoderEvents | None = None,
    ) -> None:
        self.config = config or EncoderConfig()
        self._model = model
        self._engine = engine
        self._events = events or EncoderEvents()
        self._entered = False
        self._open = False
        self._cache = PrefixCache(self.config.prefix_cache_mb * _MIB)
        self._budget = StagedBudget(self.config.staged_memory_limit_mb)
        self._regions: RegionOwner | None = None
        self._lifecycle: RequestLifecycle | None = None
        self._batcher: Batcher | None = None
        self._global: GlobalCache | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Encoder]:
        if self._entered:
            raise RuntimeError("an Encoder can be opened only once")
        self._entered = True
        # The block runs inside the Encoder's task groups; what it raises leaves as itself.
        with collapse_single_error():
            async with self._running():
                yield self

    @asynccontextmanager
    async def _running(self) -> AsyncGenerator[None]:
        config = self.config
        # Before the model loads: a bad global cache URL fails fast.
        global_settings = await global_cache_settings(config)
        async with AsyncExitStack() as stack:
            model = self._model
            if model is None:
                model = self._model = await load_configured_model(config)
            if self._engine is None:
                self._engine = await open_engine(config, stack)
            keys = None
            if global_settings is not None:
                # Entered before the request groups, so it closes after every request ended.
                self._global, keys = await open_global_cache(
                    config, global_settings, model, self._events, stack
                )
            zmq = await stack.enter_async_context(
                ZmqPushPool(sndhwm=_ZMQ_QUEUE, **config.zmq_push_options())
            )
            regions = self._regions = RegionOwner.for_model(
                self._engine, self._budget, model, config
            )
            compute = ComputePath(
                model,
                config,
                cache=self._cache,
                events=self._events,
                global_cache=self._global,
                keys=keys,
            )
            batcher = self._batcher = compute.batcher
            delivery = Delivery(regions, zmq, layout=ModelOptions.of(model).embedding_layout)
            if batcher is not None:
                # Its queue is closed even if the encoder never got as far as running it.
                stack.callback(batcher.close)
            async with anyio.create_task_group() as owner:
                await owner.start(regions.run)
                try:
                    async with anyio.create_task_group() as services:
                        if batcher is not None:
                            await services.start(batcher.run)
                        async with (
                            # Shared encodes outlive any one request that waits for them.
                            ServiceTaskGroup("encoder shared encodes") as shared,
                            ServiceTaskGroup("encoder pushes") as pushes,
                        ):
                            compute.shared.bind(shared)
                            lifecycle = self._lifecycle = RequestLifecycle(
                                config,
                                compute=compute,
                                regions=regions,
                                budget=self._budget,
                                delivery=delivery,
                                events=self._events,
                                pushes=pushes,
                            )
                            services.start_soon(lifecycle.deadlines.run)
                            self._open = True
                            try:
                                yield
                            finally:
                                self._open = False
                                await drain(lifecycle)
                        services.cancel_scope.cancel()
                finally:
                    # Every request was freed: the owner sweeps what was handed to it,
                    # deregisters the arena and ends.
                    regions.stop_accepting()

    @property
    def engine(self) -> TransferEngine | None:
        """The transfer engine in use (``None`` for ZMQ-only encoders)."""
        return self._engine

    @property
    def model(self) -> VisionModel:
        if self._model is None:
            raise ServiceUnavailableError("the encoder is not open")
        return self._model

    @property
    def is_open(self) -> bool:
        return self._open

    def _require_open(self) -> RequestLifecycle:
        if not self._open or self._lifecycle is None:
            raise ServiceUnavailableError("the encoder is not running (closed or shutting down)")
        return self._lifecycle

    # -- the public contract (DESIGN §4.5) ----------------------------------------------------

    async def encode(self, request: EncodeRequest) -> EncodeResult:
        """Encode ``request`` and stage its embedding; returns once staged.

        A checkpoint. Preprocessing and the forward run in worker threads unless the model says
        its calls do not block; the forward is batched with concurrent requests of the same
        modality. Metadata is published for :meth:`wait_metadata` as soon as preprocessing knows
        the sizes. If the caller is cancelled, nothing stays staged once the forward ends.

        :raises RequestNotActiveError: the id is live already (or was abandoned).
        :raises BadRequestError: the media or fields were rejected.
        :raises ServiceUnavailableError: over the staged-memory limit, or shutting down.
        :raises InternalError: the model broke its contract (token count mismatch…).
        """
        await (lifecycle := self._require_open()).checkpoint()
        return await lifecycle.encode(request)

    async def send(
        self, req_id: str, destination: Destination, *, receive_count: int | None = None
    ) -> None:
        """Deliver the staged embedding of ``req_id`` to ``destination``.

        A checkpoint. Waits (at most ``request_timeout_s``) for staging if the encode is in
        flight. Counts distinct destinations; once ``receive_count`` of them (default
        ``config.default_receive_count``, or the count fixed by :meth:`register_destinations`)
        finished, the request is released. A failed or cancelled send releases the request. If
        cancelled, returns only after the transfer stopped touching memory.

        :raises NotFoundError: unknown ``req_id``.
        :raises RequestNotActiveError: released or being released.
        :raises RequestTimeoutError: staging did not happen in time, or the request's
            ``send_timeout_s`` passed during the send.
        :raises TransferError: the engine or the receiver failed the transfer.
        :raises TransferTimeoutError: the transfer's outcome is unknown (the engine gave up
            waiting for a write it cannot call back): it may still land, and the
            embedding's memory is held until the engine reports the write ended.
        """
        await (lifecycle := self._require_open()).checkpoint()
        if not isinstance(destination, (ZmqDestination, MooncakeDestination)):
            raise BadRequestError("destination must be a ZmqDestination or MooncakeDestination")
        await lifecycle.send(req_id, destination, receive_count)

    async def register_destinations(
        self, req_id: str, receive_count: int, urls: list[str] | tuple[str, ...]
    ) -> None:
        """Push mode: once staged, push the embedding to each URL (ZMQ).

        A checkpoint. May arrive before :meth:`encode`: waits at most
        ``request_timeout_s`` for the request to exist; waiting or timing out creates no
        state. The first call fixes ``receive_count``.

        :raises RequestTimeoutError: the request did not appear in time.
        :raises BadRequestError: a different ``receive_count``, or bad URLs.
        :raises RequestNotActiveError: the request was released or is being released.
        """
        await (lifecycle := self._require_open()).checkpoint()
        await lifecycle.register_destinations(req_id, receive_count, urls)

    async def wait_metadata(self, req_id: str) -> EncodeResult:
        """Wait until the encode of ``req_id`` published its metadata, and return it.

        A checkpoint; at most ``request_timeout_s``. Metadata (token counts, grid, sizes)
        is published as soon as preprocessing knows it, before the forward ends. If the
        encode failed, its error is raised, also after the request's buffers were freed.
        Cancelling the wait leaves no state.

        :raises RequestTimeoutError: nothing was published in time.
        :raises RequestNotActiveError: the request was released without an error.
        """
        await (lifecycle := self._require_open()).checkpoint()
        return await lifecycle.wait_metadata(req_id)

    async def release(self, req_id: str) -> None:
        """Release ``req_id``. Idempotent; unknown ids are a no-op (an id freed a moment ago
        whose own registration is still being deregistered waits for that first).

        A checkpoint. Stops new sends and registrations at once. If an encode is in flight,
        returns without waiting; the release completes when that encode ends. Otherwise waits
        for sends in flight, then frees the memory before returning; a deregistration still
        running after ``cleanup_timeout_s`` is left to the region owner (its memory stays
        counted as staged until it returned). If cancelled while waiting, the release still
        completes on its own.

        :raises TransferTimeoutError: the request is released, but a transfer of it ended
            with an unknown outcome and may still land: its memory is held, and a release of
            the id answers this until the engine reports that transfer ended (then it
            returns as for a clean release). ``docs/cancellation.md``, the transfer contract.
        """
        lifecycle = self._lifecycle
        await (anyio.lowlevel.checkpoint() if lifecycle is None else lifecycle.checkpoint())
        if lifecycle is not None:
            await lifecycle.release(req_id)

    async def abandon(self, req_id: str) -> None:
        """Like :meth:`release`, but an id never seen is remembered (for
        ``config.abandon_ttl_s``) and refused by the encode that would create it. An id
        whose lifecycle just ended is left alone, so a retry after a failure starts
        afresh. A checkpoint."""
        lifecycle = self._lifecycle
        await (anyio.lowlevel.checkpoint() if lifecycle is None else lifecycle.checkpoint())
        if lifecycle is not None:
            await lifecycle.abandon(req_id)

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> EncoderStats:
        """A snapshot of what the encoder holds. Not a checkpoint."""
        lifecycle, regions = self._lifecycle, self._regions
        return EncoderStats(
            live_requests=0 if lifecycle is None else len(lifecycle.table),
            staged_bytes=self._budget.staged_bytes,
            registered_regions=0 if regions is None else regions.registered,
            inflight_transfers=0 if lifecycle is None else lifecycle.inflight,
            cache_entries=len(self._cache),
            held_bytes=0 if regions is None else regions.held_bytes,
            retired_ids=0 if lifecycle is None else lifecycle.table.remembered,
            retired_bytes=0 if lifecycle is None else lifecycle.table.remembered_bytes,
        )

    @property
    def cache(self) -> PrefixCache:
        return self._cache

    @property
    def global_cache(self) -> GlobalCache | None:
        """The global tier (``None`` without ``global_cache``), kept after close."""
        return self._global

    def global_cache_stats(self) -> GlobalCacheStats | None:
        """The global tier's counters (``None`` without ``global_cache``). Not a checkpoint."""
        return None if self._global is None else self._global.stats()
