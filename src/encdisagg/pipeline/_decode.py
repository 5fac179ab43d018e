"""The decode worker: admits requests to KV pages, takes their KV from prefill, decodes.

One scheduler task makes every decision synchronously (they live in :mod:`._decode_sched`),
then runs one batched decode step of every running request over the paged KV (the model in a
worker thread, or inline when its steps are that short: ``LanguageModel.blocking_steps``), and
loops while any request runs. What becomes of an aborted request's pages is the worker's
``on_release_timeout`` policy (see :class:`DecodeWorker`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final

import anyio
import anyio.lowlevel
import torch

from .. import _tracing
from .._errors import ServiceUnavailableError
from ..decode import DecodeBatch, run_decode_step, run_decode_step_inline
from ..transfer import HoldPolicy
from ._decode_sched import DecodeScheduler
from ._decode_types import DecodeJob, DecodePhase, DecodeResult, DecodeStats
from ._lm import LanguageModel
from ._pd_messages import DecodeMessage, PrefillMessage

if TYPE_CHECKING:
    from ..transfer import TransferEngine

__all__ = ["DecodeHandle", "DecodeWorker"]

_log = logging.getLogger("encdisagg.pipeline")

#: A traced request's time on the decode side, from its admission to its end.
DECODE_SPAN: Final = "encdisagg.decode"


class DecodeHandle:
    """One admitted decode request (from :meth:`DecodeWorker.admit`)."""

    def __init__(self, worker: DecodeWorker, job: DecodeJob) -> None:
        self._worker = worker
        self._job = job
        # The admitting caller's trace: the decode span joins it once the request ended.
        self._trace = _tracing.current()
        self._admitted_ns = 0 if self._trace is None else _tracing.now_ns()

    @property
    def rid(self) -> str:
        return self._job.rid

    async def wait(self) -> DecodeResult:
        """Wait until the request ended; returns how. A checkpoint.

        If the caller is cancelled, the request is aborted (its memory is then released by
        the worker, once prefill confirmed it stopped writing).
        """
        job = self._job
        try:
            await job.done.wait()
        except BaseException:
            self._worker.abort(job.rid)
            raise
        result = job.result
        assert result is not None
        if self._trace is not None:
            attributes = {
                "encdisagg.rid": result.rid,
                "encdisagg.status": result.status.value,
                "encdisagg.tokens": len(result.tokens),
                "encdisagg.retractions": result.retractions,
            }
            self._trace.record(DECODE_SPAN, self._admitted_ns, _tracing.now_ns(), attributes)
        return result


class DecodeWorker(anyio.AsyncContextManagerMixin):
    """Decodes requests whose KV a prefill worker writes into this worker's memory.

    ``async with DecodeWorker(lm, engine=...) as decode:`` registers the KV page pool and the
    metadata table with ``engine`` and starts the scheduler. Connect it to a prefill worker
    (:meth:`connect`) before the first request. Leaving the block aborts what is still live,
    waits (shielded, bounded by ``release_timeout_s``) until every page is back or retired,
    then deregisters. While a request is still held or retired then, a prefill write may
    still land in the pool and the table: neither is deregistered nor freed, both are left
    to ``engine`` (registered and alive until it closes), and this is logged.

    :param lm: the language model (its own instance: decode and prefill never share one).
    :param engine: the transfer engine prefill writes through (Loopback or Mooncake).
    :param num_pages: KV pages in the pool.
    :param page_tokens: tokens of KV per page.
    :param metadata_slots: metadata rows (requests in flight at most).
    :param release_timeout_s: how long an aborted request's pages wait for prefill's
        drained-ack before ``on_release_timeout`` applies.
    :param on_release_timeout: what becomes of an aborted request whose drained-ack did not
        come within ``release_timeout_s``: :attr:`HoldPolicy.RETIRE` (the default) keeps its
        pages and metadata slot out of use until the ack arrives after all, or for good
        (``DecodeStats.retired_pages``); :attr:`HoldPolicy.REUSE` gives them back, as SGLang
        does, and a late write may then land in another request's KV. A name works too.
    :param max_running: requests decoded together in one batched step at most.
    :param step_burst_s: with steps run inline (``lm.blocking_steps`` false), how long the
        worker steps back to back before it lets the event loop's other tasks run: longer
        bursts cost new requests that much latency and save the running ones the loop's turns.
    """

    def __init__(
        self,
        lm: LanguageModel,
        *,
        engine: TransferEngine,
        num_pages: int = 512,
        page_tokens: int = 16,
        metadata_slots: int = 64,
        release_timeout_s: float = 30.0,
        on_release_timeout: HoldPolicy | str = HoldPolicy.RETIRE,
        max_running: int = 64,
        step_burst_s: float = 0.005,
    ) -> None:
        self.lm = lm
        self.engine = engine
        self.page_bytes = page_tokens * lm.kv_bytes_per_token
        self.on_release_timeout = HoldPolicy.parse(on_release_timeout, field="on_release_timeout")
        scheduler = DecodeScheduler(
            page_tokens=page_tokens,
            engine=engine,
            page_bytes=self.page_bytes,
            num_pages=num_pages,
            metadata_slots=metadata_slots,
            release_timeout_s=release_timeout_s,
            on_release_timeout=self.on_release_timeout,
            draft_layout=lm.draft_layout,
            max_running=max_running,
            eos_token_ids=lm.eos_token_ids,
        )
        self._scheduler = scheduler
        self.pool = scheduler.pool
        self.table = scheduler.table
        self.transfer = scheduler.transfer
        # The pool seen as KV pages: [pages, layers, 2, kv_heads, page_tokens, head_dim].
        self._kv_pages = self.pool.buffer.view(lm.dtype).view(
            num_pages, *lm.kv_page_shape(page_tokens)
        )
        self.release_timeout_s = release_timeout_s
        self.step_burst_s = step_burst_s
        self._idle = anyio.Event()
        self._open = False
        self._compute = anyio.CapacityLimiter(1)

    # -- wiring ------------------------------------------------------------------------------

    def connect(self, deliver: Callable[[PrefillMessage], None]) -> None:
        """Where messages for the prefill side go (synchronous, must not block)."""
        self._scheduler.connect(deliver)

    def deliver(self, message: DecodeMessage) -> None:
        """Hand a message from prefill to the scheduler. Synchronous; never blocks."""
        self._scheduler.deliver(message)

    # -- the caller's side -------------------------------------------------------------------

    def admit(self, rid: str, room: int, *, max_new_tokens: int) -> DecodeHandle:
        """Register request ``rid``: from now on prefill's messages for it are accepted.

        Synchronous; call it before the request reaches prefill (the router's order). Await
        the handle's :meth:`DecodeHandle.wait` for the outcome.

        :raises RequestNotActiveError: ``rid`` is live already.
        :raises BadRequestError: ``room`` is not a positive integer or is in use.
        :raises ServiceUnavailableError: the worker is not running.
        """
        if not self._open:
            raise ServiceUnavailableError("the decode worker is not running", req_id=rid)
        job = self._scheduler.admit(rid, room, max_new_tokens=max_new_tokens)
        self._idle = anyio.Event()
        return DecodeHandle(self, job)

    async def wait_idle(self) -> None:
        """Wait until no request is live and every page is back (held ones included), but
        those of retired requests (``DecodeStats.retired_pages``), which only their late
        acks bring back.

        A checkpoint; unbounded: put it under a deadline.
        """
        await anyio.lowlevel.checkpoint()
        while not self._scheduler.is_idle():
            self._idle = anyio.Event()
            self._scheduler.wake.set()
            await self._idle.wait()

    async def wait_phase(self, rid: str, phase: DecodePhase) -> DecodePhase:
        """Wait until ``rid`` reached ``phase`` (or ended); returns where it is. A checkpoint."""
        await anyio.lowlevel.checkpoint()
        while True:
            job = self._scheduler.jobs.get(rid)
            if job is None:
                return DecodePhase.DONE
            if job.phase >= phase:
                return job.phase
            await job.phase_changed.wait()

    def abort(self, rid: str) -> None:
        """Abort ``rid``. Synchronous and idempotent; unknown or finished ids are ignored.

        Before prefill got pages it is told to stop; once pages are out, the room is armed
        and the abort carries its generation, and the pages stay held until prefill acks it.
        """
        self._scheduler.abort(rid)

    def stats(self) -> DecodeStats:
        return self._scheduler.stats()

    # -- lifecycle ---------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[DecodeWorker]:
        if self._open:
            raise RuntimeError("a DecodeWorker is entered once at a time")
        # Held and retired requests keep holds on the pool and the table (the sink puts them
        # there): leaving these blocks then leaves both to the engine, neither deregistered
        # nor freed under a prefill write that may still land.
        async with (
            self.pool.registered(self.engine),
            self.table.registered(self.engine),
            anyio.create_task_group() as group,
        ):
            group.start_soon(self._schedule)
            self._open = True
            try:
                yield self
            finally:
                self._open = False
                for rid in list(self._scheduler.jobs):
                    self.abort(rid)
                # Keep scheduling until every page is back or retired: held pages wait for
                # their acks (or their deadline), aborted running requests for their step.
                with anyio.move_on_after(self.release_timeout_s + 5.0, shield=True):
                    await self.wait_idle()
                if not self._scheduler.is_idle():
                    _log.error("decode worker closing with work left: %s", self.stats())
                group.cancel_scope.cancel("decode worker closing")

    # -- the scheduler task ------------------------------------------------------------------

    async def _schedule(self) -> None:
        scheduler = self._scheduler
        yielded_at = anyio.current_time()
        while True:
            scheduler.tick()
            began = anyio.current_time()
            if self.lm.blocking_steps:
                batch = await run_decode_step(
                    scheduler.batcher, self._forward, limiter=self._compute
                )
            else:
                batch = run_decode_step_inline(scheduler.batcher, self._forward)
            scheduler.collect_ended()
            if batch is not None:
                now = anyio.current_time()
                scheduler.step_seconds += now - began
                scheduler.step_tokens += len(batch)
                # Requests are running: step again. Inline steps give the event loop its
                # turn once per ``step_burst_s`` (every turn costs the batch the time the
                # loop's other tasks take); a threaded step checkpointed already.
                if not self.lm.blocking_steps and now - yielded_at >= self.step_burst_s:
                    await anyio.lowlevel.checkpoint()
                    yielded_at = anyio.current_time()
                continue
            if scheduler.is_idle():
                self._idle.set()
            deadline = scheduler.transfer.next_deadline()
            timeout = math.inf if deadline is None else max(0.0, deadline - anyio.current_time())
            with anyio.move_on_after(timeout):
                await scheduler.wake.wait()
            scheduler.wake = anyio.Event()
            yielded_at = anyio.current_time()

    # -- decoding (worker thread, or inline) -----------------------------------------------

    def _forward(self, batch: DecodeBatch) -> list[int]:
        """One batched step; first consumes the draft states of requests new to the batch."""
        fresh = [rr for rr in batch.reqs if rr.req.draft is not None]
        if fresh:
            # The draft state is read in place, from the metadata slot the request still
            # holds; the scheduler frees the slot once this step's result is in.
            hidden = torch.stack([rr.req.draft.hidden for rr in fresh])
            predicted = self.lm.draft_top1(hidden)
            for rr, top1 in zip(fresh, predicted, strict=True):
                draft = rr.req.draft
                ids = [int(i) for i in draft.top_ids.tolist()]
                rr.first_top = tuple(
                    zip(ids, (float(p) for p in draft.top_logprobs.tolist()), strict=True)
                )
                if top1 != rr.first_token or ids[0] != rr.first_token:
                    self._scheduler.draft_mismatches += 1
                    _log.warning(
                        "request %r: its draft state does not match its first token", rr.rid
                    )
        return self.lm.paged_decode_step(self._kv_pages, batch)
