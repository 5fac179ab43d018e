"""The compute path: cache tiers, preprocessing, the batched forward, validation.

A model that says its calls do not block (``blocking = False``, like ``NullVisionModel``)
is called inline, on the event loop; any other model preprocesses in a bounded pool of
worker threads and forwards through the :class:`~._batcher.Batcher`, which fuses
concurrent requests of one modality into one worker-thread call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import TypeVar

import anyio
import torch

from ... import _tracing
from ..._config import EncoderConfig
from ..._errors import (
    BadRequestError,
    InternalError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from ..._modality import Modality
from ...cache import CachedItem, GlobalCache, ItemPlan, KeySpace, Origin
from ...models import ModelOptions, Preprocessed, VisionModel
from ...nurseries import run_thread_to_completion
from .._events import EncoderEvents
from .._types import EncodeRequest
from ._batcher import Batcher, ForwardJob, check_token_count, forward_failure
from ._cache import PrefixCache
from ._flights import SharedEncodes
from ._inputs import item_subset, limited_preprocess, media_limits, preprocess_failure
from ._queued import QueuedHolding, QueuedInputs, feature_bytes
from ._traced import FORWARD_SPAN, PREPROCESS_SPAN, record_batched

__all__ = ["ComputePath"]

T = TypeVar("T")

#: Called with the preprocessed sizes as soon as they are known (early metadata).
OnPreprocessed = Callable[[Preprocessed], None]


class ComputePath:
    """Turns an :class:`EncodeRequest` into its embedding rows.

    :meth:`run` returns ``(rows, preprocessed, shared)``; ``shared`` says the rows are shared
    (with the local cache, or with a concurrent request of the same content: ``_flights``)
    and must be copied before they are staged.
    """

    def __init__(
        self,
        model: VisionModel,
        config: EncoderConfig,
        *,
        cache: PrefixCache,
        events: EncoderEvents,
        global_cache: GlobalCache | None = None,
        keys: KeySpace | None = None,
    ) -> None:
        self.model = model
        # Read once: what the model declares does not change while it serves.
        options = ModelOptions.of(model)
        self._device = options.device or torch.device("cpu")
        self._config = config
        self._cache = cache
        self._events = events
        #: Fuses forwards of a blocking model; None for a model called inline. Its task is
        #: the Encoder's to run.
        self.batcher: Batcher | None = None
        if options.blocking:
            self.batcher = Batcher(
                model,
                max_batch_size=config.max_batch_size,
                max_queued_jobs=config.max_queued_jobs,
                on_batch=lambda size, seconds: events.phase("forward", seconds),
                on_queue=lambda seconds: events.phase("queue", seconds),
            )
        self._global = global_cache
        self._keys = keys
        self._inline = not options.blocking
        self._limiter = anyio.CapacityLimiter(config.preprocess_threads)
        #: Held while a request preprocesses; its admission is decided once it holds one.
        self._slots = anyio.CapacityLimiter(config.preprocess_threads)
        self._limits = media_limits(config)
        self._preprocess = limited_preprocess(model, options, self._limits)
        #: Preprocessed bytes waiting for (or in) a forward, against queued_memory_limit_mb.
        self.queued = QueuedInputs(config.queued_memory_limit_mb)
        #: Concurrent requests of the same content share one work; the Encoder binds it.
        self.shared = SharedEncodes(
            self._run_alone, events=events, max_media_bytes=config.max_media_bytes
        )

    @property
    def inline(self) -> bool:
        """Whether :meth:`run` never waits (a model called inline, no global tier)."""
        return self._inline and self._global is None

    async def run(
        self,
        request: EncodeRequest,
        on_preprocessed: OnPreprocessed,
        trace: _tracing.Trace | None = None,
    ) -> tuple[torch.Tensor, Preprocessed, bool]:
        """Compute ``request``'s rows. A checkpoint unless :attr:`inline`. With ``trace``,
        its preprocessing, queueing and forward are spans under it.

        Decided before anything is decoded: more than ``max_items_per_request`` items is a
        400; arriving while queued inputs are at ``queued_memory_limit_mb``, a 503. Once
        admitted, the request waits (at most ``request_timeout_s``) for room under that
        budget before it preprocesses. Its preprocessed bytes count against the budget
        until its forward ends (or, cancelled, until the batcher let go of its job).
        Requests of the same content in flight at once share that work (``_flights``).
        """
        self._check_items(request)
        return await self.shared.run(request, on_preprocessed, trace)

    async def _run_alone(
        self,
        request: EncodeRequest,
        on_preprocessed: OnPreprocessed,
        trace: _tracing.Trace | None,
        digests: Sequence[str] | None,
    ) -> tuple[torch.Tensor, Preprocessed, bool]:
        """One request's own work; its queued-input bytes are given back when it ends."""
        holding = QueuedHolding(self.queued)
        try:
            # The global tier keeps rows and grids but not a video's timing (it comes from
            # the request's fps as the frames are preprocessed): a video goes past it.
            if self._global is not None and request.kind is not Modality.VIDEO:
                rows, pre = await self._encode_items(request, holding, trace, digests)
                on_preprocessed(pre)
                return rows, pre, False
            pre = await self.preprocess(request, holding=holding, trace=trace)
            on_preprocessed(pre)
            cached = self._cache_lookup(request.req_id, pre)
            if cached is not None:
                return cached, pre, True
            (output,) = await self.forward(request, [pre], holding, trace)
            self._cache_insert(pre, output)
            return output, pre, False
        finally:
            holding.release()

    def run_inline(
        self, request: EncodeRequest, on_preprocessed: OnPreprocessed
    ) -> tuple[torch.Tensor, bool]:
        """:meth:`run` as a plain call, for an :attr:`inline` path without a trace:
        ``(rows, from_cache)``. Not a checkpoint. A model called inline holds no
        queued-input bytes, so nothing is counted."""
        self._check_items(request)
        pre = self._preprocess_now(request, None)
        on_preprocessed(pre)
        cached = self._cache_lookup(request.req_id, pre)
        if cached is not None:
            return cached, True
        (output,) = self._forward_inline(request, [pre])
        self._cache_insert(pre, output)
        return output, False

    def _check_items(self, request: EncodeRequest) -> None:
        try:
            self._limits.check_items(len(request.items))
        except BadRequestError as exc:
            raise BadRequestError(
                f"req_id {request.req_id!r}: {exc.message}", req_id=request.req_id
            ) from None

    async def preprocess(
        self,
        request: EncodeRequest,
        indices: Sequence[int] | None = None,
        *,
        holding: QueuedHolding | None = None,
        trace: _tracing.Trace | None = None,
    ) -> Preprocessed:
        """Preprocess the request's items (only those at ``indices`` if given; errors then
        still name items by their place in the request). With ``holding``, a model called
        in worker threads is admitted against the queued-input budget first, and the
        result's bytes are counted in ``holding``. With ``trace``, a span under it."""
        if trace is None:
            return await self._preprocess_items(request, indices, holding)
        with trace.span(PREPROCESS_SPAN, {"encdisagg.items": len(indices or request.items)}):
            return await self._preprocess_items(request, indices, holding)

    async def _preprocess_items(
        self, request: EncodeRequest, indices: Sequence[int] | None, holding: QueuedHolding | None
    ) -> Preprocessed:
        if self._inline:
            return self._preprocess_now(request, indices)
        start = anyio.current_time()
        try:
            pre = await self._preprocess_in_thread(request, item_subset(request, indices), holding)
        except Exception as exc:
            # The cause is set there (an unmapped error leaves as itself, its cause intact).
            raise preprocess_failure(request, indices, exc)  # noqa: B904
        self._events.phase("preprocess", anyio.current_time() - start)
        return pre

    def _preprocess_now(
        self, request: EncodeRequest, indices: Sequence[int] | None
    ) -> Preprocessed:
        try:
            return self._preprocess(item_subset(request, indices), request.kind)
        except Exception as exc:
            raise preprocess_failure(request, indices, exc)  # noqa: B904

    async def _preprocess_in_thread(
        self, request: EncodeRequest, items: Sequence[object], holding: QueuedHolding | None
    ) -> Preprocessed:
        if holding is None:
            return await run_thread_to_completion(
                self._preprocess, items, request.kind, limiter=self._limiter
            )
        # Refused on arrival while the budget is used up. Once admitted, a request waits
        # for room (what finished preprocessing meanwhile may have filled the budget)
        # rather than failing: its body is already here, and a refusal would only have the
        # client send it again.
        self.queued.check_admission(request.req_id)
        async with self._slots:
            await self._bounded(
                request.req_id,
                self.queued.wait_for_room,
                "preprocessed inputs stayed at queued_memory_limit_mb",
            )
            pre = await run_thread_to_completion(
                self._preprocess, items, request.kind, limiter=self._limiter
            )
            holding.add(feature_bytes(pre.features))
        return pre

    async def forward(
        self,
        request: EncodeRequest,
        batch: Sequence[Preprocessed],
        holding: QueuedHolding | None = None,
        trace: _tracing.Trace | None = None,
    ) -> list[torch.Tensor]:
        """Forward each element of ``batch`` (the batcher may fuse them with each other and
        with other requests' jobs); every output's row count is checked. If cancelled, the
        jobs are left to the batcher, which skips them, and ``holding`` stays held until
        it is done with them. With ``trace``, the queueing and the forward are spans."""
        batcher = self.batcher
        if batcher is None:
            if trace is None:
                return self._forward_inline(request, batch)
            with trace.span(FORWARD_SPAN, {"encdisagg.batch_size": len(batch)}):
                return self._forward_inline(request, batch)
        jobs = [ForwardJob(request.req_id, request.kind, pre) for pre in batch]
        start = anyio.current_time()
        submitted_ns = 0 if trace is None else _tracing.now_ns()
        #: Jobs the batcher took; only those are sure to finish (a cancelled submit may or
        #: may not have delivered its job: counted out, its bytes are given back early).
        submitted: list[ForwardJob] = []
        try:
            for job in jobs:
                await self._bounded(
                    request.req_id, partial(batcher.submit, job), "the encode queue stayed full"
                )
                submitted.append(job)
            for job in jobs:
                await job.done.wait()
        except BaseException:
            # The batcher skips jobs nobody waits for any more.
            for job in jobs:
                job.abandoned = True
            if holding is not None:
                holding.outlive(submitted)
            raise
        self._events.phase("queue+forward", anyio.current_time() - start)
        if trace is not None:
            record_batched(trace, jobs, submitted_ns)
        outputs = []
        for job in jobs:
            if job.error is not None:
                raise job.error
            if job.output is None:
                raise ServiceUnavailableError("the encoder is shutting down", req_id=request.req_id)
            outputs.append(job.output)
        return outputs

    async def _bounded(self, req_id: str, wait: Callable[[], Awaitable[None]], what: str) -> None:
        """Await ``wait()`` for at most ``request_timeout_s``. A checkpoint.

        :raises RequestTimeoutError: saying that ``what`` lasted that long."""
        timeout = self._config.request_timeout_s
        try:
            with anyio.fail_after(timeout):
                await wait()
        except TimeoutError:
            raise RequestTimeoutError(
                f"req_id {req_id!r}: {what} for {timeout} s", req_id=req_id
            ) from None

    def _forward_inline(
        self, request: EncodeRequest, batch: Sequence[Preprocessed]
    ) -> list[torch.Tensor]:
        try:
            outputs = self.model.forward(batch)
        except Exception as exc:
            raise forward_failure(exc, request.req_id)  # noqa: B904
        if len(outputs) != len(batch):
            raise InternalError(
                f"the model returned {len(outputs)} outputs for a batch of {len(batch)}",
                req_id=request.req_id,
            )
        for output, pre in zip(outputs, batch, strict=True):
            check_token_count(output, pre, request.req_id)
        return outputs if type(outputs) is list else list(outputs)

    # -- the local tier alone ----------------------------------------------------------------

    def _cache_key(self, pre: Preprocessed) -> str | None:
        return pre.cache_key if self._config.prefix_cache_mb > 0 else None

    def _cache_lookup(self, req_id: str, pre: Preprocessed) -> torch.Tensor | None:
        key = self._cache_key(pre)
        if key is None:
            return None
        hidden, dtype = self.model.hidden_size, self.model.dtype
        tokens = sum(pre.token_counts)
        return self._counted(
            req_id, partial(self._cache.lookup, key, tokens=tokens, hidden_size=hidden, dtype=dtype)
        )

    def _cache_insert(self, pre: Preprocessed, output: torch.Tensor) -> None:
        key = self._cache_key(pre)
        if key is not None:
            self._insert([(key, output, sum(pre.token_counts), None)])

    def _counted(self, req_id: str, lookup: Callable[[], T | None]) -> T | None:
        """A lookup in the local tier, counted as a hit or a miss. An entry found invalid
        (the cache evicted it) fails the request."""
        try:
            hit = lookup()
        except ValueError as exc:
            self._events.cache("invalid")
            raise InternalError(f"req_id {req_id!r}: {exc}", req_id=req_id) from exc
        self._events.cache("hit" if hit is not None else "miss")
        return hit

    def _insert(
        self, entries: Iterable[tuple[str, torch.Tensor, int, tuple[int, ...] | None]]
    ) -> None:
        """Insert ``(key, rows, tokens, grid)`` entries in the local tier (``grid``: one
        item's entry), counting what they evicted."""
        hidden, dtype = self.model.hidden_size, self.model.dtype
        before = self._cache.stats().evictions
        for key, rows, tokens, grid in entries:
            self._cache.insert(key, rows, tokens=tokens, hidden_size=hidden, dtype=dtype, grid=grid)
        for _ in range(self._cache.stats().evictions - before):
            self._events.cache("eviction")

    # -- per item, through both cache tiers (config.global_cache set) ------------------------

    async def _encode_items(
        self,
        request: EncodeRequest,
        holding: QueuedHolding,
        trace: _tracing.Trace | None,
        digests: Sequence[str] | None,
    ) -> tuple[torch.Tensor, Preprocessed]:
        """Each item through both cache tiers (``digests``: content digests already
        computed); only misses are preprocessed and forwarded. Global-tier failures never
        fail the request (see docs/cache.md)."""
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
                max_media_bytes=self._config.max_media_bytes,
                digests=digests,
            ),
            limiter=self._limiter,
        )
        # Items that name their content elsewhere (files, URLs) are keyed by preprocessing
        # them alone; the result is reused for their forward if they miss.
        for index in plan.unkeyed():
            plan.key_by_preprocessing(
                index, await self.preprocess(request, [index], holding=holding, trace=trace)
            )
        self._local_lookup(request.req_id, plan)
        for key, item in (await global_cache.lookup(plan.open_keys())).items():
            plan.fill(key, item, Origin.GLOBAL)
        self._events.phase("cache_lookup", anyio.current_time() - start)
        group = plan.to_preprocess()
        if group:
            plan.set_preprocessed(
                group, await self.preprocess(request, group, holding=holding, trace=trace)
            )
        batch = plan.forward_batch()
        if batch:
            plan.set_outputs(await self.forward(request, batch, holding, trace))
        device = self._device
        if device.type == "cpu":
            tensor, token_counts, grid = plan.assemble(device)
        else:
            # Cached rows are copied onto the device: a copy that waits, never on the loop.
            tensor, token_counts, grid = await run_thread_to_completion(plan.assemble, device)
        self._warm_tiers(plan)
        return tensor, Preprocessed(token_counts=token_counts, grid=grid)

    def _local_lookup(self, req_id: str, plan: ItemPlan) -> None:
        if self._config.prefix_cache_mb <= 0:
            return
        model = self.model
        lookup = partial(self._cache.lookup_item, hidden_size=model.hidden_size, dtype=model.dtype)
        for key in plan.open_keys():
            hit = self._counted(req_id, partial(lookup, key))
            if hit is not None:
                rows, (tokens, grid) = hit
                plan.fill(key, CachedItem(rows=rows, tokens=tokens, grid=grid), Origin.LOCAL)

    def _warm_tiers(self, plan: ItemPlan) -> None:
        """Insert computed items in both tiers and global hits in the local one."""
        assert self._global is not None
        computed = plan.computed()
        for key, item in computed:
            self._global.insert_soon(key, item)
        if self._config.prefix_cache_mb > 0:
            self._insert(
                (key, _own_rows(item.rows), item.tokens, item.grid)
                for key, item in [*computed, *plan.fetched()]
            )


def _own_rows(rows: torch.Tensor) -> torch.Tensor:
    if rows.untyped_storage().nbytes() != rows.numel() * rows.element_size():
        # A view into a batch output or a fetched buffer: keep only its own rows, so the
        # cache's byte count is the memory it holds.
        return rows.clone()
    return rows
