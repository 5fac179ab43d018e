"""The Encoder: request lifecycle, staging and delivery of embeddings.

Ownership tree (see docs/architecture.md)::

    Encoder                      services group: batcher, orphan-region retrier
     └─ requests group           one OwningScope per live req_id
          └─ RequestScope        owns the staged tensor and its engine registration
               ├─ encode job     preprocess → batched forward → stage (+ register)
               └─ send/push jobs one per destination; transfers never abandoned

A request's memory is released only by its scope's exit, which waits for every job inside
it. State changes happen in synchronous methods (``_admit``, ``_stage_sync``,
``_note_delivered``, ``_retire``…) that never await, so the tables are consistent at every
checkpoint.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import torch

from .._config import EncoderConfig
from .._errors import (
    BadRequestError,
    EncdisaggError,
    InternalError,
    NotFoundError,
    RequestNotActiveError,
    RequestTimeoutError,
    ServiceUnavailableError,
    TransferError,
)
from ..cache import (
    CachedItem,
    GlobalCache,
    GlobalCacheStats,
    ItemPlan,
    KeySpace,
    Origin,
    ensure_mooncake_store,
    parse_global_cache_url,
    relabel_items,
)
from ..models import Preprocessed, VisionModel, load_model
from ..nurseries import (
    KeyedRendezvous,
    KeyRemovedError,
    OwningScope,
    ScopeClosedError,
    ServiceTaskGroup,
    run_thread_to_completion,
)
from ..transfer import EmbeddingHeader, TransferEngine, ZmqPushPool, payload_view
from ._batcher import Batcher, ForwardJob
from ._cache import PrefixCache
from ._types import (
    Destination,
    EncodeRequest,
    EncodeResult,
    EncoderStats,
    MooncakeDestination,
    ZmqDestination,
)

__all__ = ["Encoder", "EncoderEvents"]

_log = logging.getLogger("encdisagg.encoder")

_MIB = 1024 * 1024
#: How many released ids are remembered (to answer 409 rather than 404, and to keep error
#: metadata for late waiters). Bounded so a long-running encoder does not grow.
_RETIRED_LIMIT = 10_000
_ABANDONED_LIMIT = 10_000


class _Phase(enum.Enum):
    ENCODING = "encoding"
    STAGED = "staged"
    FAILED = "failed"


@dataclass(eq=False)
class _Request:
    """What a request scope owns. Mutated only on the event loop, in synchronous code,
    except ``registered_ptr`` which the registering worker thread records itself (the
    caller waits for that thread, so nothing reads it concurrently)."""

    request: EncodeRequest
    scope: OwningScope[_Request] | None = None
    phase: _Phase = _Phase.ENCODING
    #: Sticky: once set, no new sends or destination registrations are accepted.
    release_requested: bool = False
    tensor: torch.Tensor | None = None
    nbytes: int = 0
    result: EncodeResult | None = None
    error: EncdisaggError | None = None
    #: Address of the shared engine registration, or None (none, or it failed).
    registered_ptr: int | None = None
    staged: anyio.Event = field(default_factory=anyio.Event)
    receive_count: int | None = None
    delivered: set[str] = field(default_factory=set)
    push_urls: list[str] = field(default_factory=list)
    #: Serialises per-send fallback registrations of this request's memory.
    fallback_lock: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def req_id(self) -> str:
        return self.request.req_id


@dataclass(frozen=True, slots=True)
class _Retired:
    expires_at: float
    error: EncdisaggError | None


@dataclass(eq=False, slots=True)
class _OrphanRegion:
    """A registration whose deregistration failed: its memory stays alive until a retry
    succeeds, so the engine never points at freed memory."""

    ptr: int
    tensor: torch.Tensor
    nbytes: int
    attempts: int = 0


class _DeregisterFailed(TransferError):
    """A per-send fallback region could not be deregistered after its write."""

    def __init__(
        self, message: str, *, req_id: str | None, ptr: int, write_error: BaseException | None
    ) -> None:
        super().__init__(message, req_id=req_id)
        self.ptr = ptr
        self.write_error = write_error


class _Counter:
    """An integer shared with worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, delta: int) -> None:
        with self._lock:
            self.value += delta


@dataclass
class EncoderEvents:
    """Optional callbacks the Encoder calls (synchronously, on its event loop) as work
    completes; the server's metrics hang here. Callbacks must not block."""

    on_request_done: Callable[[str, str, float], None] | None = None  # modality, status, seconds
    on_phase: Callable[[str, float], None] | None = None  # phase name, seconds
    on_cache: Callable[[str], None] | None = None  # "hit" | "miss" | "eviction" | "invalid"
    #: Global cache counters, ``(event, items)``: see :class:`~encdisagg.cache.GlobalCache`.
    on_global_cache: Callable[[str, int], None] | None = None
    on_breaker: Callable[[str], None] | None = None  # "closed" | "open" | "half_open"


def _error_copy(error: EncdisaggError) -> EncdisaggError:
    # The same exception object must not be raised in several tasks (tracebacks pile up);
    # every waiter gets its own copy.
    copy = type(error)(error.message, req_id=error.req_id)
    copy.__cause__ = error.__cause__
    return copy


class Encoder(anyio.AsyncContextManagerMixin):
    """An encoder service embedded in the caller's process.

    Constructing does nothing. ``async with Encoder(config) as encoder`` loads the model
    (unless one is given), starts the transfer engine the config asks for (unless one is
    given), and starts the batcher. Leaving the block releases every live request, waits
    (up to ``config.shutdown_grace_s``) for every transfer, and deregisters everything.

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
        # Request table. `_requests` holds every admitted, not yet retired request (also
        # while its scope is still starting); `_live` publishes them once their scope runs,
        # so register_destinations can wait for a request to appear.
        self._requests: dict[str, _Request] = {}
        self._live: KeyedRendezvous[str, _Request] = KeyedRendezvous()
        self._outcomes: KeyedRendezvous[str, EncodeResult | EncdisaggError] = KeyedRendezvous()
        self._retired: OrderedDict[str, _Retired] = OrderedDict()
        self._abandoned: OrderedDict[str, float] = OrderedDict()
        self._orphans: list[_OrphanRegion] = []
        self._orphans_changed = anyio.Event()
        self._staged_bytes = 0
        self._inflight = 0
        self._registered = _Counter()
        self._cache = PrefixCache(self.config.prefix_cache_mb * _MIB)
        self._preprocess_limiter = anyio.CapacityLimiter(self.config.preprocess_threads)
        self._batcher: Batcher | None = None
        self._zmq: ZmqPushPool | None = None
        self._request_group: ServiceTaskGroup | None = None
        # The global tier and its keys, when config.global_cache is set (while open).
        self._global: GlobalCache | None = None
        self._keys: KeySpace | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Encoder]:
        if self._entered:
            raise RuntimeError("an Encoder can be opened only once")
        self._entered = True
        config = self.config
        global_settings = None
        if config.global_cache is not None:
            # Before the model loads: a bad URL fails fast.
            global_settings = parse_global_cache_url(
                config.global_cache, default_host=config.mooncake_host
            )
            await run_thread_to_completion(ensure_mooncake_store)
        async with AsyncExitStack() as stack:
            if self._model is None:
                self._model = await run_thread_to_completion(
                    lambda: load_model(
                        config.model,
                        dtype=config.dtype,
                        device=config.device,
                        max_media_bytes=config.max_media_bytes,
                        remote_media_domains=config.remote_media_domains,
                        allow_local_files=config.allow_local_files,
                    )
                )
            if self._engine is None:
                self._engine = await self._open_engine(stack)
            if global_settings is not None:
                # Entered before the request groups, so it closes after every request ended.
                model = self._model
                self._keys = KeySpace.for_model(model)
                self._global = await stack.enter_async_context(
                    GlobalCache(
                        global_settings,
                        hidden_size=model.hidden_size,
                        dtype=model.dtype,
                        on_event=self._events.on_global_cache,
                        on_breaker=self._events.on_breaker,
                        close_timeout_s=config.cleanup_timeout_s,
                    )
                )
            self._zmq = await stack.enter_async_context(
                ZmqPushPool(send_timeout_s=config.zmq_send_timeout_s)
            )
            self._batcher = Batcher(
                self._model,
                max_batch_size=config.max_batch_size,
                max_queued_jobs=config.max_queued_jobs,
                on_batch=self._on_batch,
                on_queue=self._on_queue,
            )
            async with ServiceTaskGroup("encoder services") as services:
                await services.start(self._batcher.run, name="batcher")
                services.start_soon(self._retry_orphans, name="orphan-region retrier")
                async with ServiceTaskGroup("encoder requests") as requests:
                    self._request_group = requests
                    self._open = True
                    try:
                        yield self
                    finally:
                        self._open = False
                        await self._drain(requests)
                await self._final_orphan_sweep()

    async def _open_engine(self, stack: AsyncExitStack) -> TransferEngine | None:
        config = self.config
        if config.transfer == "mooncake":
            from ..transfer import MooncakeEngine

            engine: TransferEngine = await stack.enter_async_context(
                MooncakeEngine(
                    hostname=config.mooncake_host,
                    metadata_server=config.mooncake_metadata,
                    protocol=config.mooncake_protocol,
                    device_name=config.mooncake_device,
                )
            )
            return engine
        if config.transfer == "loopback":
            from ..transfer import LoopbackEngine

            return LoopbackEngine()
        return None

    async def _drain(self, requests: ServiceTaskGroup) -> None:
        """Release every live request; give transfers in flight a grace period."""
        for req in list(self._requests.values()):
            req.release_requested = True
            if req.scope is not None:
                req.scope.wind_down()
        with anyio.move_on_after(self.config.shutdown_grace_s, shield=True):
            for req in list(self._requests.values()):
                if req.scope is not None:
                    await req.scope.wait_closed()
        # Whatever is still running is cancelled now; transfers inside are shielded and
        # never abandoned, so the scopes still release only after them.
        for req in list(self._requests.values()):
            if req.scope is not None:
                req.scope.cancel()

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

    def _require_open(self) -> None:
        if not self._open:
            raise ServiceUnavailableError("the encoder is not running (closed or shutting down)")

    # -- synchronous decisions ------------------------------------------------------------

    def _prune(self) -> None:
        now = anyio.current_time()
        while self._retired:
            key, entry = next(iter(self._retired.items()))
            if entry.expires_at > now and len(self._retired) <= _RETIRED_LIMIT:
                break
            del self._retired[key]
        while self._abandoned:
            key, expires_at = next(iter(self._abandoned.items()))
            if expires_at > now and len(self._abandoned) <= _ABANDONED_LIMIT:
                break
            del self._abandoned[key]

    def _admit(self, request: EncodeRequest) -> _Request:
        """Reserve ``request.req_id`` for a fresh lifecycle, or refuse."""
        req_id = request.req_id
        if req_id in self._requests:
            raise RequestNotActiveError(f"req_id {req_id!r} is live already", req_id=req_id)
        limit = self.config.staged_memory_limit_mb
        if limit is not None and self._staged_bytes >= limit * _MIB:
            raise ServiceUnavailableError(
                f"staged embeddings use {self._staged_bytes} bytes, at the limit of "
                f"staged_memory_limit_mb={limit}; retry later",
                req_id=req_id,
            )
        self._prune()
        if self._abandoned.pop(req_id, None) is not None:
            self._retire_id(req_id, None)
            raise RequestNotActiveError(
                f"req_id {req_id!r} was abandoned before its encode", req_id=req_id
            )
        # A reused id starts afresh: forget what its previous lifecycle left behind.
        self._retired.pop(req_id, None)
        req = _Request(request)
        self._requests[req_id] = req
        return req

    def _retire_id(self, req_id: str, error: EncdisaggError | None) -> None:
        self._retired[req_id] = _Retired(
            anyio.current_time() + self.config.request_timeout_s, error
        )
        self._retired.move_to_end(req_id)

    def _retire(self, req: _Request) -> None:
        """Forget a request whose memory is gone; keep its error for late waiters."""
        if self._requests.get(req.req_id) is req:
            del self._requests[req.req_id]
            if self._live.get(req.req_id) is req:
                self._live.remove(req.req_id)
            self._retire_id(req.req_id, req.error)
            # Wakes metadata waiters; they find the retired entry (and its error).
            self._outcomes.remove(req.req_id)

    def _request_release(self, req: _Request) -> None:
        """Stop new work for ``req``; its scope ends once the work in flight ended."""
        req.release_requested = True
        if req.phase is not _Phase.ENCODING and req.scope is not None:
            req.scope.wind_down()

    def _fail(self, req: _Request, error: EncdisaggError) -> None:
        req.phase = _Phase.FAILED
        req.error = error
        try:
            self._outcomes.publish(req.req_id, error)
        except Exception:
            _log.exception("publishing the error of req_id %r failed", req.req_id)
        req.staged.set()
        if req.scope is not None:
            for url in req.push_urls:
                self._start_push(req, url)

    def _note_delivered(self, req: _Request, identity: str) -> None:
        req.delivered.add(identity)
        needed = req.receive_count or self.config.default_receive_count
        if len(req.delivered) >= needed:
            self._request_release(req)

    def _fix_receive_count(self, req: _Request, receive_count: int | None) -> None:
        if receive_count is None:
            return
        if isinstance(receive_count, bool) or not isinstance(receive_count, int):
            raise BadRequestError("receive_count must be an integer", req_id=req.req_id)
        if receive_count < 1:
            raise BadRequestError(
                f"receive_count must be at least 1; got {receive_count}", req_id=req.req_id
            )
        if req.receive_count is not None and req.receive_count != receive_count:
            raise BadRequestError(
                f"receive_count {receive_count} differs from the {req.receive_count} "
                f"registered first for req_id {req.req_id!r}",
                req_id=req.req_id,
            )
        req.receive_count = receive_count

    def _lookup(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            self._prune()
            if req_id in self._retired:
                raise RequestNotActiveError(f"req_id {req_id!r} was released", req_id=req_id)
            raise NotFoundError(f"req_id {req_id!r} is unknown", req_id=req_id)
        if req.release_requested:
            raise RequestNotActiveError(f"req_id {req_id!r} is being released", req_id=req_id)
        return req

    # -- encode ---------------------------------------------------------------------------

    async def encode(self, request: EncodeRequest) -> EncodeResult:
        """Encode ``request`` and stage its embedding; returns once staged.

        A checkpoint. Preprocessing and the forward run in worker threads; the forward is
        batched with concurrent requests of the same modality. If the caller is cancelled,
        nothing stays staged once the forward ends.

        :raises RequestNotActiveError: the id is live already (or was abandoned).
        :raises BadRequestError: the media or fields were rejected.
        :raises ServiceUnavailableError: over the staged-memory limit, or shutting down.
        :raises InternalError: the model broke its contract (token count mismatch…).
        """
        await anyio.lowlevel.checkpoint()
        self._require_open()
        req = self._admit(request)
        started = anyio.current_time()
        status = "error"
        try:
            scope: OwningScope[_Request] = OwningScope(
                _acquired(req),
                self._free,
                name=f"request {request.req_id!r}",
                cleanup_timeout=self.config.cleanup_timeout_s,
            )
            req.scope = scope
            assert self._request_group is not None
            await self._request_group.start(scope.run, name=f"request {request.req_id}")
            self._live.publish(request.req_id, req)
            try:
                result = await scope.call(self._encode_job, req)
            except ScopeClosedError:
                raise RequestNotActiveError(
                    f"req_id {request.req_id!r} ended during its encode",
                    req_id=request.req_id,
                ) from None
            status = "ok"
            if req.release_requested:
                # A release asked for during the encode applies now; it completes before
                # the caller hears back.
                scope.wind_down()
                await self._settle(req)
            return result
        except Exception as exc:
            if isinstance(exc, EncdisaggError):
                status = {400: "bad_request", 503: "unavailable"}.get(exc.status, "error")
            # Failed: nothing of it may stay staged, and the caller sees it gone.
            self._abort_encode(req)
            await self._settle(req)
            raise
        except BaseException:
            # Cancelled: the encode job already stopped (scope.call waited for it); the
            # scope frees the rest on its own.
            self._abort_encode(req)
            raise
        finally:
            if self._events.on_request_done is not None:
                self._events.on_request_done(
                    request.kind.value, status, anyio.current_time() - started
                )

    def _abort_encode(self, req: _Request) -> None:
        req.release_requested = True
        if req.scope is not None:
            req.scope.wind_down()
        elif self._requests.get(req.req_id) is req:
            del self._requests[req.req_id]

    async def _settle(self, req: _Request) -> None:
        """Wait (shielded, bounded) until a request that is winding down has been freed."""
        if req.scope is None:
            return
        with anyio.move_on_after(self.config.cleanup_timeout_s, shield=True):
            await req.scope.wait_closed()

    async def _encode_job(self, req: _Request) -> EncodeResult:
        request = req.request
        try:
            if self._global is not None:
                assembled, pre = await self._encode_items(req)
                await self._stage(req, pre, assembled, copy=False)
            else:
                pre = await self._preprocess(request)
                output = self._cache_lookup(req, pre)
                cached = output is not None
                if output is None:
                    output = await self._forward(req, pre)
                    self._cache_insert(pre, output)
                await self._stage(req, pre, output, copy=cached)
        except EncdisaggError as exc:
            if exc.req_id is None:
                exc.req_id = req.req_id
            self._fail(req, exc)
            raise
        except Exception as exc:
            internal = InternalError(
                f"req_id {req.req_id!r}: encoding failed: {exc!r}", req_id=req.req_id
            )
            internal.__cause__ = exc
            self._fail(req, internal)
            raise internal from exc
        assert req.result is not None
        return req.result

    async def _preprocess(
        self, request: EncodeRequest, indices: Sequence[int] | None = None
    ) -> Preprocessed:
        """Preprocess the request's items (only those at ``indices`` if given; errors then
        still name items by their place in the request)."""
        model = self.model
        start = anyio.current_time()
        items = request.items if indices is None else [request.items[i] for i in indices]
        try:
            pre = await run_thread_to_completion(
                model.preprocess,
                items,
                request.kind,
                limiter=self._preprocess_limiter,
            )
        except EncdisaggError as exc:
            if indices is None:
                raise
            raise type(exc)(relabel_items(exc.message, indices), req_id=exc.req_id) from exc
        except (ValueError, TypeError) as exc:
            detail = str(exc) if indices is None else relabel_items(str(exc), indices)
            raise BadRequestError(
                f"req_id {request.req_id!r}: preprocessing rejected the input: {detail}",
                req_id=request.req_id,
            ) from exc
        except Exception as exc:
            raise InternalError(
                f"req_id {request.req_id!r}: preprocessing failed: {exc!r}",
                req_id=request.req_id,
            ) from exc
        self._phase_done("preprocess", start)
        return pre

    async def _forward(self, req: _Request, pre: Preprocessed) -> torch.Tensor:
        (output,) = await self._forward_all(req, [pre])
        return output

    async def _forward_all(
        self, req: _Request, batch: Sequence[Preprocessed]
    ) -> list[torch.Tensor]:
        """Forward each element of ``batch`` as a job of ``req`` (the batcher may fuse them
        with each other and with other requests' jobs)."""
        assert self._batcher is not None
        jobs = [ForwardJob(req.req_id, req.request.kind, pre) for pre in batch]
        start = anyio.current_time()
        try:
            for job in jobs:
                try:
                    with anyio.fail_after(self.config.request_timeout_s):
                        await self._batcher.submit(job)
                except TimeoutError:
                    raise RequestTimeoutError(
                        f"req_id {req.req_id!r}: the encode queue stayed full for "
                        f"{self.config.request_timeout_s} s",
                        req_id=req.req_id,
                    ) from None
            for job in jobs:
                await job.done.wait()
        except BaseException:
            # The batcher skips jobs nobody waits for any more.
            for job in jobs:
                job.abandoned = True
            raise
        self._phase_done("queue+forward", start)
        outputs = []
        for job in jobs:
            if job.error is not None:
                raise job.error
            if job.output is None:
                raise ServiceUnavailableError("the encoder is shutting down", req_id=req.req_id)
            outputs.append(job.output)
        return outputs

    # -- the per-item path through both cache tiers (config.global_cache set) ---------------

    async def _encode_items(self, req: _Request) -> tuple[torch.Tensor, Preprocessed]:
        """Key each item; take local hits, then global hits; preprocess and forward only the
        rest; assemble in item order; insert what was computed (global: in the background).
        Global-tier failures never fail the request (see docs/cache.md)."""
        request = req.request
        global_cache, keys = self._global, self._keys
        assert global_cache is not None
        assert keys is not None
        start = anyio.current_time()
        key_builder = keys.for_modality(request.kind.value)
        plan = await run_thread_to_completion(
            lambda: ItemPlan.build(
                request.items,
                request.hashes,
                key_builder,
                max_media_bytes=self.config.max_media_bytes,
            ),
            limiter=self._preprocess_limiter,
        )
        # Items that name their content elsewhere (files, URLs) are keyed by preprocessing
        # them alone; the result is reused for their forward if they miss.
        for index in plan.unkeyed():
            plan.key_by_preprocessing(index, await self._preprocess(request, [index]))
        self._local_lookup(req, plan)
        for key, item in (await global_cache.lookup(plan.open_keys())).items():
            plan.fill(key, item, Origin.GLOBAL)
        self._phase_done("cache_lookup", start)
        group = plan.to_preprocess()
        if group:
            plan.set_preprocessed(group, await self._preprocess(request, group))
        batch = plan.forward_batch()
        if batch:
            plan.set_outputs(await self._forward_all(req, batch))
        device = getattr(self.model, "device", None)
        tensor, token_counts, grid = plan.assemble(
            device if isinstance(device, torch.device) else torch.device("cpu")
        )
        self._warm_tiers(plan)
        return tensor, Preprocessed(token_counts=token_counts, grid=grid)

    def _local_lookup(self, req: _Request, plan: ItemPlan) -> None:
        if self.config.prefix_cache_mb <= 0:
            return
        model = self.model
        for key in plan.open_keys():
            try:
                hit = self._cache.lookup_item(key, hidden_size=model.hidden_size, dtype=model.dtype)
            except ValueError as exc:
                self._cache_event("invalid")
                raise InternalError(f"req_id {req.req_id!r}: {exc}", req_id=req.req_id) from exc
            self._cache_event("hit" if hit is not None else "miss")
            if hit is not None:
                rows, (tokens, grid) = hit
                plan.fill(key, CachedItem(rows=rows, tokens=tokens, grid=grid), Origin.LOCAL)

    def _warm_tiers(self, plan: ItemPlan) -> None:
        """Insert computed items in both tiers and global hits in the local one."""
        assert self._global is not None
        computed = plan.computed()
        for key, item in computed:
            self._global.insert_soon(key, item)
        if self.config.prefix_cache_mb <= 0:
            return
        model = self.model
        before = self._cache.stats().evictions
        for key, item in [*computed, *plan.fetched()]:
            rows = item.rows
            if rows.untyped_storage().nbytes() != rows.numel() * rows.element_size():
                # A view into a batch output or a fetched buffer: keep only its own rows, so
                # the cache's byte count is the memory it holds.
                rows = rows.clone()
            self._cache.insert(
                key,
                rows,
                tokens=item.tokens,
                hidden_size=model.hidden_size,
                dtype=model.dtype,
                grid=item.grid,
            )
        for _ in range(self._cache.stats().evictions - before):
            self._cache_event("eviction")

    def _cache_key_ok(self, pre: Preprocessed) -> bool:
        return self.config.prefix_cache_mb > 0 and pre.cache_key is not None

    def _cache_lookup(self, req: _Request, pre: Preprocessed) -> torch.Tensor | None:
        if not self._cache_key_ok(pre):
            return None
        assert pre.cache_key is not None
        model = self.model
        try:
            hit = self._cache.lookup(
                pre.cache_key,
                tokens=sum(pre.token_counts),
                hidden_size=model.hidden_size,
                dtype=model.dtype,
            )
        except ValueError as exc:
            self._cache_event("invalid")
            raise InternalError(f"req_id {req.req_id!r}: {exc}", req_id=req.req_id) from exc
        self._cache_event("hit" if hit is not None else "miss")
        return hit

    def _cache_insert(self, pre: Preprocessed, output: torch.Tensor) -> None:
        if not self._cache_key_ok(pre):
            return
        assert pre.cache_key is not None
        model = self.model
        before = self._cache.stats().evictions
        self._cache.insert(
            pre.cache_key,
            output,
            tokens=sum(pre.token_counts),
            hidden_size=model.hidden_size,
            dtype=model.dtype,
        )
        for _ in range(self._cache.stats().evictions - before):
            self._cache_event("eviction")

    def _cache_event(self, what: str) -> None:
        if self._events.on_cache is not None:
            self._events.on_cache(what)

    async def _stage(
        self, req: _Request, pre: Preprocessed, output: torch.Tensor, *, copy: bool
    ) -> None:
        tensor = output.detach()
        # A cache hit must not share memory with the cache (or another request's region).
        tensor = tensor.clone() if copy or not tensor.is_contiguous() else tensor
        self._stage_sync(req, pre, tensor)
        engine = self._engine
        if engine is not None:
            try:
                await run_thread_to_completion(self._register_shared, engine, req)
            except TransferError as exc:
                # Rule: the shared region is an optimisation; each send registers its own.
                _log.warning(
                    "req_id %r: registering the staged embedding failed (%s); "
                    "falling back to per-send registration",
                    req.req_id,
                    exc,
                )
        self._publish_staged(req)

    def _stage_sync(self, req: _Request, pre: Preprocessed, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        limit = self.config.staged_memory_limit_mb
        if limit is not None and self._staged_bytes + nbytes > limit * _MIB:
            raise ServiceUnavailableError(
                f"req_id {req.req_id!r}: staging {nbytes} bytes would pass "
                f"staged_memory_limit_mb={limit}; retry later",
                req_id=req.req_id,
            )
        req.tensor = tensor
        req.nbytes = nbytes
        self._staged_bytes += nbytes
        req.result = EncodeResult(
            req_id=req.req_id,
            num_tokens=int(tensor.shape[0]),
            hidden_size=int(tensor.shape[1]),
            dtype=str(tensor.dtype).removeprefix("torch."),
            nbytes=nbytes,
            token_counts=tuple(int(n) for n in pre.token_counts),
            grid=tuple(tuple(int(v) for v in g) for g in pre.grid),
        )

    def _register_shared(self, engine: TransferEngine, req: _Request) -> None:
        # Runs in a worker thread; records the registration itself so that a cancellation
        # delivered after it returns cannot lose track of it.
        tensor = req.tensor
        assert tensor is not None
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        ptr = tensor.data_ptr()
        engine.register(ptr, req.nbytes)
        req.registered_ptr = ptr
        self._registered.add(1)

    def _publish_staged(self, req: _Request) -> None:
        assert req.result is not None
        assert req.scope is not None
        req.phase = _Phase.STAGED
        self._outcomes.publish(req.req_id, req.result)
        req.staged.set()
        req.scope.deadline = anyio.current_time() + self.config.send_timeout_s
        for url in req.push_urls:
            self._start_push(req, url)

    # -- release of a request's memory (the scope's exit) -----------------------------------

    async def _free(self, req: _Request) -> None:
        """Release what ``req`` owns. Runs once, shielded and bounded, after every job of
        the request's scope has returned."""
        try:
            if req.registered_ptr is not None:
                engine = self._engine
                assert engine is not None
                try:
                    await run_thread_to_completion(self._deregister_shared, engine, req)
                except Exception as exc:
                    _log.error(
                        "req_id %r: deregistering its staged embedding failed; "
                        "keeping the memory and retrying later",
                        req.req_id,
                        exc_info=exc,
                    )
        finally:
            # Bookkeeping that must happen however the above ended (failed, or cut short
            # by the cleanup bound): a region still registered keeps its memory alive.
            if req.registered_ptr is not None and req.tensor is not None:
                self._orphan(req.registered_ptr, req.tensor, req.nbytes)
            elif req.tensor is not None:
                self._staged_bytes -= req.nbytes
            req.registered_ptr = None
            req.tensor = None
            self._retire(req)

    def _deregister_shared(self, engine: TransferEngine, req: _Request) -> None:
        # Runs in a worker thread and records the outcome itself, so a cancellation
        # delivered after it returned cannot lose track of it.
        assert req.registered_ptr is not None
        engine.deregister(req.registered_ptr)
        req.registered_ptr = None
        self._registered.add(-1)

    def _orphan(self, ptr: int, tensor: torch.Tensor, nbytes: int) -> None:
        # Ownership moves from the request to the encoder; its bytes stay counted.
        self._orphans.append(_OrphanRegion(ptr, tensor, nbytes))
        self._orphans_changed.set()

    async def _retry_orphans(self) -> None:
        delay = 1.0
        while True:
            if not self._orphans:
                await self._orphans_changed.wait()
                self._orphans_changed = anyio.Event()
                delay = 1.0
                continue
            await anyio.sleep(delay)
            await self._deregister_orphans()
            delay = min(delay * 2, 60.0)

    async def _deregister_orphans(self) -> None:
        engine = self._engine
        assert engine is not None
        for orphan in list(self._orphans):
            try:
                await run_thread_to_completion(engine.deregister, orphan.ptr)
            except Exception as exc:
                orphan.attempts += 1
                _log.warning(
                    "retrying deregistration of region %#x failed (attempt %d): %s",
                    orphan.ptr,
                    orphan.attempts,
                    exc,
                )
                continue
            self._orphans.remove(orphan)
            self._registered.add(-1)
            self._staged_bytes -= orphan.nbytes

    async def _final_orphan_sweep(self) -> None:
        if not self._orphans:
            return
        with anyio.move_on_after(self.config.cleanup_timeout_s, shield=True):
            await self._deregister_orphans()
        for orphan in self._orphans:
            _log.error(
                "region %#x (%d bytes) could not be deregistered before shutdown",
                orphan.ptr,
                orphan.nbytes,
            )

    # -- send and push ----------------------------------------------------------------------

    async def send(
        self, req_id: str, destination: Destination, *, receive_count: int | None = None
    ) -> None:
        """Deliver the staged embedding of ``req_id`` to ``destination``.

        A checkpoint. Waits (at most ``request_timeout_s``) for staging if the encode is in
        flight. Counts distinct destinations; once ``receive_count`` of them (default
        ``config.default_receive_count``, or the count fixed by
        :meth:`register_destinations`) finished, the request is released. A failed or
        cancelled send releases the request. If cancelled, returns only after the transfer
        stopped touching memory.

        :raises NotFoundError: unknown ``req_id``.
        :raises RequestNotActiveError: released or being released.
        :raises RequestTimeoutError: staging did not happen in time.
        :raises TransferError: the engine or the receiver failed the transfer.
        """
        await anyio.lowlevel.checkpoint()
        self._require_open()
        if not isinstance(destination, (ZmqDestination, MooncakeDestination)):
            raise BadRequestError("destination must be a ZmqDestination or MooncakeDestination")
        req = self._lookup(req_id)
        self._fix_receive_count(req, receive_count)
        if req.scope is None or self._live.get(req_id) is not req:
            req = await self._wait_live(req_id)
        scope = req.scope
        assert scope is not None
        try:
            await scope.call(self._deliver, req, destination)
        except ScopeClosedError:
            if scope.expired:
                raise RequestTimeoutError(
                    f"req_id {req_id!r} was not delivered within send_timeout_s="
                    f"{self.config.send_timeout_s} and was released",
                    req_id=req_id,
                ) from None
            raise RequestNotActiveError(f"req_id {req_id!r} was released", req_id=req_id) from None
        except Exception:
            self._request_release(req)
            await self._settle(req)
            raise
        except BaseException:
            self._request_release(req)
            raise
        if req.release_requested:
            # This send completed the delivery (or a release is pending): the request is
            # freed once the sends still in flight finished; the caller sees it gone.
            await self._settle(req)

    async def _wait_live(self, req_id: str) -> _Request:
        try:
            with anyio.fail_after(self.config.request_timeout_s):
                return await self._live.wait(req_id)
        except TimeoutError:
            raise RequestTimeoutError(
                f"req_id {req_id!r} did not appear within {self.config.request_timeout_s} s",
                req_id=req_id,
            ) from None
        except KeyRemovedError:
            raise RequestNotActiveError(f"req_id {req_id!r} was released", req_id=req_id) from None

    async def _deliver(self, req: _Request, destination: Destination) -> None:
        if not req.staged.is_set():
            try:
                with anyio.fail_after(self.config.request_timeout_s):
                    await req.staged.wait()
            except TimeoutError:
                raise RequestTimeoutError(
                    f"req_id {req.req_id!r} was not staged within "
                    f"{self.config.request_timeout_s} s",
                    req_id=req.req_id,
                ) from None
        if req.phase is _Phase.FAILED:
            assert req.error is not None
            raise _error_copy(req.error)
        if req.release_requested and destination.identity not in req.delivered:
            raise RequestNotActiveError(f"req_id {req.req_id!r} was released", req_id=req.req_id)
        start = anyio.current_time()
        self._inflight += 1
        try:
            if isinstance(destination, MooncakeDestination):
                await self._write_mooncake(req, destination)
            else:
                await self._push_zmq(req, destination.url)
        finally:
            self._inflight -= 1
        self._phase_done("transfer", start)
        self._note_delivered(req, destination.identity)

    async def _write_mooncake(self, req: _Request, destination: MooncakeDestination) -> None:
        engine = self._engine
        if engine is None:
            raise TransferError(
                f"req_id {req.req_id!r}: a Mooncake destination needs transfer='mooncake'",
                req_id=req.req_id,
            )
        if req.registered_ptr is not None:
            await run_thread_to_completion(self._write_registered, engine, req, destination)
            return
        async with req.fallback_lock:
            try:
                await run_thread_to_completion(
                    self._write_with_own_registration, engine, req, destination
                )
            except _DeregisterFailed as exc:
                assert req.tensor is not None
                # The region outlives the request until a retry deregisters it; its bytes
                # stay counted until then.
                self._staged_bytes += req.nbytes
                self._orphan(exc.ptr, req.tensor, req.nbytes)
                if exc.write_error is not None:
                    raise exc.write_error from None
                raise

    @staticmethod
    def _write_registered(
        engine: TransferEngine, req: _Request, destination: MooncakeDestination
    ) -> None:
        assert req.tensor is not None
        engine.write(
            destination.session_id, req.tensor.data_ptr(), destination.buffer_address, req.nbytes
        )

    def _write_with_own_registration(
        self, engine: TransferEngine, req: _Request, destination: MooncakeDestination
    ) -> None:
        # Runs in a worker thread: register, write, deregister, all before returning, so
        # the per-send registration never outlives this call.
        assert req.tensor is not None
        ptr = req.tensor.data_ptr()
        engine.register(ptr, req.nbytes)
        self._registered.add(1)
        write_error: BaseException | None = None
        try:
            engine.write(destination.session_id, ptr, destination.buffer_address, req.nbytes)
        except BaseException as exc:
            write_error = exc
        try:
            engine.deregister(ptr)
        except Exception as exc:
            raise _DeregisterFailed(
                f"req_id {req.req_id!r}: deregistering the per-send region failed: {exc}",
                req_id=req.req_id,
                ptr=ptr,
                write_error=write_error,
            ) from exc
        self._registered.add(-1)
        if write_error is not None:
            raise write_error

    def _header(self, req: _Request) -> EmbeddingHeader:
        request = req.request
        if req.phase is _Phase.FAILED:
            assert req.error is not None
            return EmbeddingHeader(
                req_id=req.req_id,
                num_parts=request.num_parts,
                part_idx=request.part_idx,
                modality=request.kind.value,
                shape=(0, 0),
                dtype="float16",
                token_counts=(),
                grid=(),
                error=req.error.message,
                status=req.error.status,
            )
        result = req.result
        assert result is not None
        return EmbeddingHeader(
            req_id=req.req_id,
            num_parts=request.num_parts,
            part_idx=request.part_idx,
            modality=request.kind.value,
            shape=(result.num_tokens, result.hidden_size),
            dtype=result.dtype,
            token_counts=result.token_counts,
            grid=result.grid,
        )

    async def _push_zmq(self, req: _Request, url: str) -> None:
        assert self._zmq is not None
        header = self._header(req)
        if req.phase is _Phase.FAILED:
            await self._zmq.send(url, header, None)
            return
        tensor = req.tensor
        assert tensor is not None
        host = tensor if tensor.device.type == "cpu" else tensor.cpu()
        payload = payload_view(host)
        # Returns only once ZMQ no longer references `payload`.
        await self._zmq.send(url, header, payload)

    def _start_push(self, req: _Request, url: str) -> None:
        assert req.scope is not None
        try:
            req.scope.start_soon(self._push_task, req, url)
        except ScopeClosedError:
            _log.warning("req_id %r: not pushing to %s, the request ended", req.req_id, url)

    async def _push_task(self, req: _Request, url: str) -> None:
        try:
            if req.phase is _Phase.FAILED:
                await self._push_zmq(req, url)
                return
            await self._deliver(req, ZmqDestination(url))
        except Exception as exc:
            _log.error("req_id %r: pushing to %s failed", req.req_id, url, exc_info=exc)
            self._request_release(req)

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
        await anyio.lowlevel.checkpoint()
        self._require_open()
        if not isinstance(urls, (list, tuple)) or not urls:
            raise BadRequestError("receive_url must be a non-empty list of URLs", req_id=req_id)
        destinations = [ZmqDestination(url) for url in urls]
        if (
            isinstance(receive_count, bool)
            or not isinstance(receive_count, int)
            or receive_count < 1
        ):
            raise BadRequestError(
                f"receive_count must be a positive integer; got {receive_count!r}", req_id=req_id
            )
        req = self._requests.get(req_id)
        if req is None:
            self._prune()
            if req_id in self._retired:
                raise RequestNotActiveError(f"req_id {req_id!r} was released", req_id=req_id)
        if req is None or self._live.get(req_id) is not req:
            req = await self._wait_live(req_id)
        if req.release_requested or req.scope is None or not req.scope.accepting:
            raise RequestNotActiveError(f"req_id {req_id!r} is being released", req_id=req_id)
        self._fix_receive_count(req, receive_count)
        for destination in destinations:
            if destination.url in req.push_urls:
                continue
            req.push_urls.append(destination.url)
            if req.phase is not _Phase.ENCODING:
                self._start_push(req, destination.url)

    # -- metadata, release, abandon ----------------------------------------------------------

    async def wait_metadata(self, req_id: str) -> EncodeResult:
        """Wait until the encode of ``req_id`` published its result, and return it.

        A checkpoint; at most ``request_timeout_s``. If the encode failed, its error is
        raised, also after the request's buffers were freed.

        :raises RequestTimeoutError: nothing was published in time.
        :raises RequestNotActiveError: the request was released without an error.
        """
        await anyio.lowlevel.checkpoint()
        outcome = self._outcomes.get(req_id)
        if outcome is None:
            if req_id not in self._requests:
                self._raise_retired(req_id)
            try:
                with anyio.fail_after(self.config.request_timeout_s):
                    outcome = await self._outcomes.wait(req_id)
            except TimeoutError:
                raise RequestTimeoutError(
                    f"no metadata for req_id {req_id!r} within {self.config.request_timeout_s} s",
                    req_id=req_id,
                ) from None
            except KeyRemovedError:
                self._raise_retired(req_id)
                raise RequestNotActiveError(
                    f"req_id {req_id!r} was released", req_id=req_id
                ) from None
        if isinstance(outcome, EncdisaggError):
            raise _error_copy(outcome)
        return outcome

    def _raise_retired(self, req_id: str) -> None:
        self._prune()
        retired = self._retired.get(req_id)
        if retired is None:
            return
        if retired.error is not None:
            raise _error_copy(retired.error)
        raise RequestNotActiveError(f"req_id {req_id!r} was released", req_id=req_id)

    async def release(self, req_id: str) -> None:
        """Release ``req_id``. Idempotent; unknown ids are a no-op.

        A checkpoint. Stops new sends and registrations at once. If an encode is in flight,
        returns without waiting; the release completes when that encode ends. Otherwise
        waits for sends in flight, then frees the memory before returning. If cancelled
        while waiting, the release still completes in the request's own scope.
        """
        await anyio.lowlevel.checkpoint()
        req = self._requests.get(req_id)
        if req is None:
            return
        req.release_requested = True
        if req.phase is _Phase.ENCODING or req.scope is None:
            return
        req.scope.wind_down()
        await req.scope.wait_closed()

    async def abandon(self, req_id: str) -> None:
        """Like :meth:`release`, but an id that does not exist yet is remembered (for
        ``config.abandon_ttl_s``) and released as soon as an encode creates it. A
        checkpoint."""
        await anyio.lowlevel.checkpoint()
        if req_id in self._requests:
            await self.release(req_id)
            return
        self._prune()
        self._abandoned[req_id] = anyio.current_time() + self.config.abandon_ttl_s
        self._abandoned.move_to_end(req_id)

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> EncoderStats:
        """A snapshot of what the encoder holds. Not a checkpoint."""
        return EncoderStats(
            live_requests=len(self._requests),
            staged_bytes=self._staged_bytes,
            registered_regions=self._registered.value,
            inflight_transfers=self._inflight,
            cache_entries=len(self._cache),
        )

    @property
    def cache(self) -> PrefixCache:
        return self._cache

    @property
    def global_cache(self) -> GlobalCache | None:
        """The global tier with ``global_cache`` set (kept after close, for its counters),
        else None."""
        return self._global

    def global_cache_stats(self) -> GlobalCacheStats | None:
        """The global tier's counters (``None`` without ``global_cache``). Not a checkpoint."""
        return None if self._global is None else self._global.stats()

    def _phase_done(self, phase: str, start: float) -> None:
        if self._events.on_phase is not None:
            self._events.on_phase(phase, anyio.current_time() - start)

    def _on_queue(self, seconds: float) -> None:
        if self._events.on_phase is not None:
            self._events.on_phase("queue", seconds)

    def _on_batch(self, size: int, seconds: float) -> None:
        if self._events.on_phase is not None:
            self._events.on_phase("forward", seconds)


def _acquired(req: _Request) -> Callable[[], Any]:
    async def acquire() -> _Request:
        return req

    return acquire
