"""The decode worker's decisions: admission, aborts, and one scheduling pass at a time.

Everything here is synchronous and never awaits, so the state is consistent at every
checkpoint of the worker around it. A pass (:meth:`DecodeScheduler.tick`) works the decode
side's queues in the order the decode docs prescribe: handle prefill's messages, resolve held
releases, preallocate and hand the pages to prefill, pop what transferred. Committed requests
join the waiting queue of the batch scheduler (:class:`~encdisagg.decode.DecodeBatchScheduler`)
that the worker steps; :meth:`DecodeScheduler.collect_ended` turns the requests it finished
into results.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from .._errors import BadRequestError, RequestNotActiveError, ServiceUnavailableError
from .._numbers import whole
from ..decode import (
    AbortAckTracker,
    CommitStatus,
    DecodeBatchScheduler,
    DecodePreallocQueue,
    DecodeRequest,
    DecodeTransferQueue,
    DraftLayout,
    FinishReason,
    KVPagePool,
    KVPoll,
    MetadataSlotAllocator,
    MetadataSlotTable,
    PagedKVBackup,
    PagedKVSink,
    PreallocRequest,
    RunningRequest,
)
from ._decode_types import DecodeJob, DecodePhase, DecodeResult, DecodeStats, DecodeStatus
from ._pd_messages import (
    ROPE_DELTA_WORD,
    SEQ_LEN_WORD,
    AbortRequest,
    BootstrapInfo,
    DecodeMessage,
    DrainedAck,
    KVDestination,
    PrefillMessage,
)

if TYPE_CHECKING:
    from ..transfer import HoldPolicy, TransferEngine

__all__ = ["DecodeScheduler"]

_log = logging.getLogger("encdisagg.pipeline")


class _PipelineSink(PagedKVSink):
    """Commits also read the pipeline's extra row words (RoPE offset, prompt length) before
    the transfer queue zeroes the slot."""

    def __init__(self, scheduler: DecodeScheduler) -> None:
        super().__init__(scheduler.pool, scheduler.table, on_abort=scheduler._on_sink_abort)
        self._scheduler = scheduler
        self.corrupt = 0

    def commit(self, req: DecodeRequest) -> CommitStatus:
        status = super().commit(req)
        if status is CommitStatus.CORRUPT:
            self.corrupt += 1
        elif status is CommitStatus.COMMITTED:
            assert req.metadata_slot is not None
            assert req.metadata is not None
            row = self.table.rows[req.metadata_slot]
            # Views into the slot, not copies: the transfer queue keeps the slot for them
            # until the first decode step read them.
            req.draft = self._scheduler.draft_layout.views(self.table.extra(req.metadata_slot))
            self._scheduler._on_commit(req, int(row[ROPE_DELTA_WORD]), int(row[SEQ_LEN_WORD]))
        return status


class DecodeScheduler:
    """The state and decisions of a :class:`~encdisagg.pipeline.DecodeWorker`.

    ``wake`` is set whenever there is something for the next pass to do; the worker waits on
    it (or on the transfer queue's next deadline) between passes and replaces it after.

    :param page_tokens: tokens of KV per page (``page_bytes`` holds exactly that many).
    :param engine: the engine the pages are registered with (its session goes to prefill).
    :param on_release_timeout: what the transfer queue does with an aborted request whose
        drained-ack did not come within ``release_timeout_s`` (its ``on_timeout``).
    :param draft_layout: where prefill's draft state sits in a metadata row.
    :param max_running: requests in the running batch at most.
    :param eos_token_ids: tokens that end a request.
    """

    def __init__(
        self,
        *,
        page_tokens: int,
        engine: TransferEngine,
        page_bytes: int,
        num_pages: int,
        metadata_slots: int,
        release_timeout_s: float,
        on_release_timeout: HoldPolicy,
        draft_layout: DraftLayout,
        max_running: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.engine = engine
        self.page_bytes = page_bytes
        self.page_tokens = page_tokens
        self.draft_layout = draft_layout
        self.pool = KVPagePool(num_pages, page_bytes)
        self.table = MetadataSlotTable(metadata_slots, extra_words=draft_layout.words)
        self.slots = MetadataSlotAllocator(metadata_slots, zero_slot=self.table.zero)
        self.acks = AbortAckTracker()
        self.sink = _PipelineSink(self)
        self.prealloc = DecodePreallocQueue(pages=self.pool, slots=self.slots)
        self.transfer = DecodeTransferQueue(
            kv=self.sink,
            slots=self.slots,
            acks=self.acks,
            release_timeout_s=release_timeout_s,
            clock=anyio.current_time,
            on_timeout=on_release_timeout,
            page_bytes=page_bytes,
        )
        self.batcher = DecodeBatchScheduler(
            transfer=self.transfer,
            prealloc=self.prealloc,
            pages=self.pool,
            page_tokens=self.page_tokens,
            max_running=max_running,
            kv_backup=PagedKVBackup(self.pool),
            eos_token_ids=eos_token_ids,
            clock=anyio.current_time,
        )
        self.jobs: dict[str, DecodeJob] = {}
        self.wake = anyio.Event()
        #: Draft states whose hidden state did not predict the first token they came with.
        self.draft_mismatches = 0
        #: Time spent in batched decode steps (loop clock), and the tokens they produced.
        self.step_seconds = 0.0
        self.step_tokens = 0
        self._prefill: Callable[[PrefillMessage], None] | None = None
        self._polls: dict[str, KVPoll] = {}
        self._inbox: deque[DecodeMessage] = deque()
        self._counts = dict.fromkeys(DecodeStatus, 0)
        self._held_releases = 0
        self._drained = 0
        self._timed_out = 0
        self._retirements = 0

    # -- wiring ------------------------------------------------------------------------------

    def connect(self, deliver: Callable[[PrefillMessage], None]) -> None:
        self._prefill = deliver

    def deliver(self, message: DecodeMessage) -> None:
        self._inbox.append(message)
        self.wake.set()

    def _send(self, message: PrefillMessage) -> None:
        if self._prefill is None:
            raise ServiceUnavailableError("the decode worker is not connected to a prefill worker")
        self._prefill(message)

    # -- the caller's side -------------------------------------------------------------------

    def admit(self, rid: str, room: int, *, max_new_tokens: int) -> DecodeJob:
        """Register ``rid``; see :meth:`~encdisagg.pipeline.DecodeWorker.admit`."""
        if rid in self.jobs:
            raise RequestNotActiveError(f"request {rid!r} is live already", req_id=rid)
        whole("room", room, least=1, error=functools.partial(BadRequestError, req_id=rid))
        if any(job.room == room for job in self.jobs.values()):
            raise BadRequestError(f"room {room} is in use", req_id=rid)
        job = DecodeJob(rid, room, max_new_tokens, started_at=anyio.current_time())
        self.jobs[rid] = job
        return job

    def abort(self, rid: str) -> None:
        """Abort ``rid``; see :meth:`~encdisagg.pipeline.DecodeWorker.abort`."""
        job = self.jobs.get(rid)
        if job is None or job.aborted or job.phase is DecodePhase.DONE:
            return
        job.aborted = True
        phase = job.phase
        if phase is DecodePhase.WAITING:
            self._send(AbortRequest(rid, job.room, None))
            self.finish(job, DecodeStatus.ABORTED, "aborted before prefill finished")
        elif phase is DecodePhase.PREALLOC:
            self._send(AbortRequest(rid, job.room, None))
            self._polls[rid] = KVPoll.Failed
        elif phase is DecodePhase.TRANSFER:
            req = job.req
            assert req is not None
            # Arm before sending: an ack that races ahead of the scheduler still counts.
            req.generation = self.acks.arm(req.room)
            self._send(AbortRequest(rid, req.room, req.generation))
            req.abort_notified = True
            self._polls[rid] = KVPoll.Failed
        elif phase is DecodePhase.DECODING:
            assert job.running is not None
            self.batcher.request_abort(job.running)
        self.wake.set()

    def is_idle(self) -> bool:
        """Whether nothing is left to do: retired requests are no work (only their acks,
        which may never come, release them)."""
        return not (
            self.jobs
            or self.prealloc.queue
            or self.transfer.queue
            or self.transfer.deferred
            or not self.batcher.is_idle()
        )

    def stats(self) -> DecodeStats:
        pool_free = self.pool.available()
        transfer = self.transfer
        in_use = self.pool.num_pages - pool_free
        held_pages = transfer.held_pages
        retired_pages = transfer.retired_pages
        # Pages owned by live work (queued, held, or decoding) and by retired requests.
        owned = sum(len(r.pages) for r in transfer.queue) + held_pages + retired_pages
        batcher = self.batcher
        owned += batcher.owned_pages()
        return DecodeStats(
            live=len(self.jobs),
            prealloc_queued=len(self.prealloc.queue),
            transfer_queued=len(transfer.queue),
            held=len(transfer.held),
            decoding=len(batcher.running) + len(batcher.waiting) + len(batcher.retracted),
            leaked_pages=max(0, in_use - owned),
            pages_free=pool_free,
            pages_total=self.pool.num_pages,
            slots_free=self.slots.available(),
            slots_total=self.slots.size,
            completed=self._counts[DecodeStatus.COMPLETED],
            aborted=self._counts[DecodeStatus.ABORTED],
            failed=self._counts[DecodeStatus.FAILED],
            corrupt=self.sink.corrupt,
            held_releases=self._held_releases,
            drained_releases=self._drained,
            timed_out_releases=self._timed_out,
            release_failures=self.transfer.release_failures,
            decode_steps=batcher.steps,
            retractions=batcher.retractions,
            resumptions=batcher.resumptions,
            draft_mismatches=self.draft_mismatches,
            step_seconds=self.step_seconds,
            step_tokens=self.step_tokens,
            held_pages=held_pages,
            retired=len(transfer.retired),
            retired_pages=retired_pages,
            retirements=self._retirements,
            held_bytes=transfer.held_bytes,
        )

    # -- one pass ----------------------------------------------------------------------------

    def tick(self) -> None:
        """One scheduling pass: messages, held releases, preallocation, committed requests
        into the batch scheduler's waiting queue."""
        while self._inbox:
            self._handle(self._inbox.popleft())
        resolution = self.transfer.resolve_deferred()
        self._drained += len(resolution.drained)
        self._timed_out += len(resolution.timed_out)
        self._retirements += len(resolution.retired)
        passed = self.prealloc.pop_preallocated(self._polls)
        for gone in passed.failed:
            job = self.jobs.get(gone.rid)
            if job is not None:
                self.finish(job, *self._failure(job, "prefill failed before KV pages were given"))
        for req in passed.preallocated:
            job = self.jobs.get(req.rid)
            assert job is not None
            job.req = req
            job.advance(DecodePhase.TRANSFER)
            self.transfer.add(req)
            self._polls[req.rid] = KVPoll.Transferring
            self._send(
                KVDestination(
                    rid=req.rid,
                    room=req.room,
                    session_id=self.engine.session_id,
                    page_bytes=self.page_bytes,
                    page_addresses=tuple(self.pool.page_address(p) for p in req.pages),
                    row_address=self.table.row_address(req.metadata_slot or 0),
                    row_bytes=self.table.row_bytes,
                )
            )
        held_before = len(self.transfer.held)
        committed = self.transfer.pop_transferred(self._polls)
        self._held_releases += len(self.transfer.held) - held_before
        for req in committed:
            job = self.jobs.get(req.rid)
            self._polls.pop(req.rid, None)
            if job is None or job.phase is DecodePhase.DONE:
                # Finished meanwhile (cannot happen: an abort sets Failed first); free it.
                self.transfer.free_metadata(req)
                self.sink.release(req)
                continue
            running = RunningRequest(
                req,
                max_new_tokens=job.max_new_tokens,
                kv_len=job.seq_len,
                first_token=job.first_token,
                position_offset=job.rope_delta,
            )
            job.running = running
            job.advance(DecodePhase.DECODING)
            self.batcher.add(running)

    def collect_ended(self) -> None:
        """Give every request the batch scheduler finished its result."""
        for running in self.batcher.take_ended():
            job = self.jobs.get(running.rid)
            if job is None or job.running is not running:
                continue
            job.first_top = running.first_top
            job.retractions = running.retractions
            tokens = tuple(running.output)
            if running.finished is FinishReason.ABORTED:
                self.finish(job, DecodeStatus.ABORTED, "aborted while decoding", tokens)
            elif running.finished is FinishReason.FAILED:
                self.finish(job, DecodeStatus.FAILED, running.error, tokens)
            else:
                self.finish(job, DecodeStatus.COMPLETED, tokens=tokens)

    def _handle(self, message: DecodeMessage) -> None:
        if isinstance(message, DrainedAck):
            self.acks.ack(message.room, message.rank, message.generation)
            return
        job = self.jobs.get(message.rid)
        if job is None or job.room != message.room or job.phase is DecodePhase.DONE:
            return
        if isinstance(message, BootstrapInfo):
            if job.phase is not DecodePhase.WAITING or job.aborted:
                return
            job.seq_len = message.seq_len
            pages = max(1, -(-message.seq_len // self.page_tokens))
            # Alone in the pool it must be able to finish, or retraction could never help it.
            needed = -(-(message.seq_len + job.max_new_tokens) // self.page_tokens)
            try:
                if needed > self.pool.num_pages:
                    raise BadRequestError(
                        f"request {job.rid!r} needs {needed} KV pages for its prompt and "
                        f"{job.max_new_tokens} new tokens; the pool has {self.pool.num_pages}",
                        req_id=job.rid,
                    )
                self.prealloc.add(PreallocRequest(job.rid, job.room, pages, required_acks=1))
            except BadRequestError as exc:
                self._send(AbortRequest(job.rid, job.room, None))
                self.finish(job, DecodeStatus.FAILED, exc.message)
                return
            self._polls[job.rid] = KVPoll.WaitingForInput
            job.advance(DecodePhase.PREALLOC)
            return
        # TransferDone
        if job.phase is DecodePhase.WAITING:
            if not message.ok:
                self.finish(job, DecodeStatus.FAILED, message.error)
            return
        if job.phase in (DecodePhase.PREALLOC, DecodePhase.TRANSFER) and not job.aborted:
            if not message.ok:
                job.error = message.error
            self._polls[job.rid] = KVPoll.Success if message.ok else KVPoll.Failed

    def _failure(self, job: DecodeJob, message: str) -> tuple[DecodeStatus, str]:
        if job.aborted:
            return DecodeStatus.ABORTED, "aborted"
        return DecodeStatus.FAILED, job.error or message

    def _on_sink_abort(self, req: DecodeRequest, message: str) -> None:
        job = self.jobs.get(req.rid)
        if job is not None and job.req is req:
            self.finish(job, *self._failure(job, message))

    def _on_commit(self, req: DecodeRequest, rope_delta: int, seq_len: int) -> None:
        job = self.jobs.get(req.rid)
        if job is None or job.req is not req or req.metadata is None:
            return
        job.rope_delta = rope_delta
        job.first_token = req.metadata.first_token_id
        job.checksum = req.metadata.checksum
        job.first_token_at = anyio.current_time()
        if seq_len != job.seq_len:
            _log.warning(
                "request %r: metadata says %d tokens, bootstrap said %d",
                req.rid,
                seq_len,
                job.seq_len,
            )

    # -- endings -----------------------------------------------------------------------------

    def finish(
        self, job: DecodeJob, status: DecodeStatus, error: str = "", tokens: tuple[int, ...] = ()
    ) -> None:
        """Give ``job`` its result and wake its waiters; the first ending wins."""
        if job.phase is DecodePhase.DONE:
            return
        job.result = DecodeResult(
            rid=job.rid,
            status=status,
            tokens=tokens,
            error=error,
            checksum=job.checksum if status is DecodeStatus.COMPLETED else 0,
            first_top=job.first_top,
            retractions=job.retractions,
            started_at=job.started_at,
            first_token_at=job.first_token_at,
            finished_at=anyio.current_time(),
        )
        self._counts[status] += 1
        job.advance(DecodePhase.DONE)
        self._polls.pop(job.rid, None)
        if self.jobs.get(job.rid) is job:
            del self.jobs[job.rid]
        job.done.set()
        self.wake.set()
