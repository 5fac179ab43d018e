"""The decode worker: admits requests to KV pages, takes their KV from prefill, decodes.

One scheduler task makes every decision synchronously, on the decode side's queues
(:class:`~encdisagg.decode.DecodePreallocQueue`, :class:`~encdisagg.decode.DecodeTransferQueue`),
in the order the decode docs prescribe: resolve held releases, preallocate, hand the pages to
prefill, pop what transferred. Committed requests are decoded in tasks of the worker's own task
group (the model runs in a worker thread); their pages are freed when their decode ends. An
aborted request whose pages were handed out is held by the transfer queue until prefill's
drained-ack for that abort's generation arrives, or ``release_timeout_s`` passes.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import anyio
import anyio.abc
import anyio.lowlevel
import torch

from .._errors import (
    BadRequestError,
    EncdisaggError,
    RequestNotActiveError,
    ServiceUnavailableError,
)
from ..decode import (
    AbortAckTracker,
    CommitStatus,
    DecodePreallocQueue,
    DecodeRequest,
    DecodeTransferQueue,
    KVPagePool,
    KVPoll,
    MetadataSlotAllocator,
    MetadataSlotTable,
    PagedKVSink,
    PreallocRequest,
)
from ..nurseries import run_thread_to_completion
from ._lm import LanguageModel
from ._messages import (
    AbortRequest,
    BootstrapInfo,
    DecodeMessage,
    DrainedAck,
    KVDestination,
    PrefillMessage,
)

if TYPE_CHECKING:
    from ..transfer import TransferEngine

__all__ = [
    "DecodeHandle",
    "DecodePhase",
    "DecodeResult",
    "DecodeStats",
    "DecodeStatus",
    "DecodeWorker",
]

_log = logging.getLogger("encdisagg.pipeline")

#: Words of a metadata row past the four the decode side defines: the pipeline writes the
#: multimodal RoPE offset and the prompt length there.
ROPE_DELTA_WORD: Final = 4
SEQ_LEN_WORD: Final = 5


class DecodePhase(enum.IntEnum):
    """Where a decode request is. It only moves forward."""

    #: Registered; prefill has not said how long the prompt is.
    WAITING = 0
    #: Waiting for KV pages and a metadata slot.
    PREALLOC = 1
    #: Pages handed to prefill: KV may land at any time.
    TRANSFER = 2
    #: KV committed; decoding.
    DECODING = 3
    #: Finished (its pages may still be held, see the transfer queue).
    DONE = 4


class DecodeStatus(enum.Enum):
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """How a decode request ended."""

    rid: str
    status: DecodeStatus
    tokens: tuple[int, ...] = ()
    error: str = ""
    #: The checksum of the committed KV (as written by prefill, verified on the pages).
    checksum: int = 0
    #: Clock readings (``anyio.current_time()``): registered, first token known, finished.
    started_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float = 0.0


@dataclass(frozen=True, slots=True)
class DecodeStats:
    """A snapshot of the worker. The first six are zero, and ``pages_free`` /
    ``slots_free`` equal their totals, when it is idle."""

    live: int
    prealloc_queued: int
    transfer_queued: int
    held: int
    decoding: int
    leaked_pages: int
    pages_free: int
    pages_total: int
    slots_free: int
    slots_total: int
    completed: int
    aborted: int
    failed: int
    corrupt: int
    held_releases: int
    drained_releases: int
    timed_out_releases: int
    release_failures: int


@dataclass(eq=False)
class _Job:
    rid: str
    room: int
    max_new_tokens: int
    started_at: float
    phase: DecodePhase = DecodePhase.WAITING
    aborted: bool = False
    req: DecodeRequest | None = None
    seq_len: int = 0
    rope_delta: int = 0
    checksum: int = 0
    first_token: int = 0
    first_token_at: float | None = None
    #: Why prefill failed the request, if it did.
    error: str = ""
    result: DecodeResult | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    phase_changed: anyio.Event = field(default_factory=anyio.Event)
    #: Read by the decode thread between tokens.
    stop: threading.Event = field(default_factory=threading.Event)

    def advance(self, phase: DecodePhase) -> None:
        self.phase = phase
        self.phase_changed.set()
        self.phase_changed = anyio.Event()


class _PipelineSink(PagedKVSink):
    """Commits also read the pipeline's extra row words (RoPE offset, prompt length) before
    the transfer queue zeroes the slot."""

    def __init__(self, worker: DecodeWorker) -> None:
        super().__init__(worker.pool, worker.table, on_abort=worker._on_sink_abort)
        self._worker = worker
        self.corrupt = 0

    def commit(self, req: DecodeRequest) -> CommitStatus:
        status = super().commit(req)
        if status is CommitStatus.CORRUPT:
            self.corrupt += 1
        elif status is CommitStatus.COMMITTED:
            assert req.metadata_slot is not None
            assert req.metadata is not None
            row = self.table.rows[req.metadata_slot]
            self._worker._on_commit(req, int(row[ROPE_DELTA_WORD]), int(row[SEQ_LEN_WORD]))
        return status


class DecodeHandle:
    """One admitted decode request (from :meth:`DecodeWorker.admit`)."""

    def __init__(self, worker: DecodeWorker, job: _Job) -> None:
        self._worker = worker
        self._job = job

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
        assert job.result is not None
        return job.result


class DecodeWorker(anyio.AsyncContextManagerMixin):
    """Decodes requests whose KV a prefill worker writes into this worker's memory.

    ``async with DecodeWorker(lm, engine=...) as decode:`` registers the KV page pool and the
    metadata table with ``engine`` and starts the scheduler. Connect it to a prefill worker
    (:meth:`connect`) before the first request. Leaving the block aborts what is still live,
    waits (shielded, bounded by ``release_timeout_s``) until every page is back, then
    deregisters.

    :param lm: the language model (its own instance: decode and prefill never share one).
    :param engine: the transfer engine prefill writes through (Loopback or Mooncake).
    :param num_pages: KV pages in the pool.
    :param page_tokens: tokens of KV per page.
    :param metadata_slots: metadata rows (requests in flight at most).
    :param release_timeout_s: how long an aborted request's pages wait for prefill's
        drained-ack at most.
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
    ) -> None:
        self.lm = lm
        self.engine = engine
        self.page_bytes = page_tokens * lm.kv_bytes_per_token
        self.pool = KVPagePool(num_pages, self.page_bytes)
        self.table = MetadataSlotTable(metadata_slots)
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
        )
        self.release_timeout_s = release_timeout_s
        self._prefill: Callable[[PrefillMessage], None] | None = None
        self._jobs: dict[str, _Job] = {}
        self._polls: dict[str, KVPoll] = {}
        self._inbox: deque[DecodeMessage] = deque()
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._group: anyio.abc.TaskGroup | None = None
        self._open = False
        self._decoding = 0
        self._compute = anyio.CapacityLimiter(1)
        self._counts = dict.fromkeys(DecodeStatus, 0)
        self._held_releases = 0
        self._drained = 0
        self._timed_out = 0

    # -- wiring ------------------------------------------------------------------------------

    def connect(self, deliver: Callable[[PrefillMessage], None]) -> None:
        """Where messages for the prefill side go (synchronous, must not block)."""
        self._prefill = deliver

    def deliver(self, message: DecodeMessage) -> None:
        """Hand a message from prefill to the scheduler. Synchronous; never blocks."""
        self._inbox.append(message)
        self._poke()

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
        if rid in self._jobs:
            raise RequestNotActiveError(f"request {rid!r} is live already", req_id=rid)
        if isinstance(room, bool) or not isinstance(room, int) or room <= 0:
            raise BadRequestError(f"room must be a positive integer; got {room!r}", req_id=rid)
        if any(job.room == room for job in self._jobs.values()):
            raise BadRequestError(f"room {room} is in use", req_id=rid)
        job = _Job(rid, room, max_new_tokens, started_at=anyio.current_time())
        self._jobs[rid] = job
        self._idle = anyio.Event()
        return DecodeHandle(self, job)

    async def generate(self, rid: str, room: int, *, max_new_tokens: int) -> DecodeResult:
        """:meth:`admit` and wait for the outcome. A checkpoint; see :meth:`DecodeHandle.wait`."""
        return await self.admit(rid, room, max_new_tokens=max_new_tokens).wait()

    async def wait_idle(self) -> None:
        """Wait until no request is live and every page is back (held ones included).

        A checkpoint; unbounded: put it under a deadline.
        """
        await anyio.lowlevel.checkpoint()
        while not self._is_idle():
            self._idle = anyio.Event()
            self._poke()
            await self._idle.wait()

    async def wait_phase(self, rid: str, phase: DecodePhase) -> DecodePhase:
        """Wait until ``rid`` reached ``phase`` (or ended); returns where it is. A checkpoint."""
        await anyio.lowlevel.checkpoint()
        while True:
            job = self._jobs.get(rid)
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
        job = self._jobs.get(rid)
        if job is None or job.aborted or job.phase is DecodePhase.DONE:
            return
        job.aborted = True
        phase = job.phase
        if phase is DecodePhase.WAITING:
            self._send(AbortRequest(rid, job.room, None))
            self._finish(job, DecodeStatus.ABORTED, "aborted before prefill finished")
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
            job.stop.set()
        self._poke()

    def stats(self) -> DecodeStats:
        pool_free = self.pool.available()
        held = len(self.transfer.deferred)
        in_use = self.pool.num_pages - pool_free
        # Pages owned by live work: queued, held, or decoding.
        owned = sum(len(r.pages) for r in self.transfer.queue) + sum(
            len(r.pages) for r in self.transfer.deferred
        )
        owned += sum(
            len(job.req.pages)
            for job in self._jobs.values()
            if job.req is not None and job.phase is DecodePhase.DECODING
        )
        return DecodeStats(
            live=len(self._jobs),
            prealloc_queued=len(self.prealloc.queue),
            transfer_queued=len(self.transfer.queue),
            held=held,
            decoding=self._decoding,
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
        )

    # -- lifecycle ---------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[DecodeWorker]:
        if self._open:
            raise RuntimeError("a DecodeWorker is entered once at a time")
        async with (
            self.pool.registered(self.engine),
            self.table.registered(self.engine),
            anyio.create_task_group() as group,
        ):
            self._group = group
            group.start_soon(self._schedule)
            self._open = True
            try:
                yield self
            finally:
                self._open = False
                for rid in list(self._jobs):
                    self.abort(rid)
                # Keep scheduling until every page is back: held pages wait for their acks
                # (or their deadline), decodes for their thread.
                with anyio.move_on_after(self.release_timeout_s + 5.0, shield=True):
                    await self.wait_idle()
                if not self._is_idle():
                    _log.error("decode worker closing with work left: %s", self.stats())
                group.cancel_scope.cancel("decode worker closing")
                self._group = None

    def _is_idle(self) -> bool:
        return not (
            self._jobs
            or self.prealloc.queue
            or self.transfer.queue
            or self.transfer.deferred
            or self._decoding
        )

    # -- the scheduler -----------------------------------------------------------------------

    def _poke(self) -> None:
        self._wake.set()

    async def _schedule(self) -> None:
        while True:
            self._tick()
            if self._is_idle():
                self._idle.set()
            deadline = self.transfer.next_deadline()
            timeout = math.inf if deadline is None else max(0.0, deadline - anyio.current_time())
            with anyio.move_on_after(timeout):
                await self._wake.wait()
            self._wake = anyio.Event()

    def _tick(self) -> None:
        """One scheduling pass. Synchronous: consistent at every checkpoint."""
        while self._inbox:
            self._handle(self._inbox.popleft())
        self._resolve_held()
        passed = self.prealloc.pop_preallocated(self._polls)
        for gone in passed.failed:
            job = self._jobs.get(gone.rid)
            if job is not None:
                self._finish(job, *self._failure(job, "prefill failed before KV pages were given"))
        for req in passed.preallocated:
            job = self._jobs.get(req.rid)
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
            job = self._jobs.get(req.rid)
            if job is None or job.phase is DecodePhase.DONE:
                # Finished meanwhile (cannot happen: an abort sets Failed first); free it.
                self.sink.release(req)
                continue
            self._polls.pop(req.rid, None)
            job.advance(DecodePhase.DECODING)
            self._decoding += 1
            assert self._group is not None
            self._group.start_soon(self._decode, job)

    def _resolve_held(self) -> None:
        held = {id(entry.req): entry.deadline for entry in self.transfer.held}
        if not held:
            return
        now = anyio.current_time()
        for req in self.transfer.resolve_deferred_releases():
            if now < held[id(req)]:
                self._drained += 1
            else:
                self._timed_out += 1

    def _handle(self, message: DecodeMessage) -> None:
        if isinstance(message, DrainedAck):
            self.acks.ack(message.room, message.rank, message.generation)
            return
        job = self._jobs.get(message.rid)
        if job is None or job.room != message.room or job.phase is DecodePhase.DONE:
            return
        if isinstance(message, BootstrapInfo):
            if job.phase is not DecodePhase.WAITING or job.aborted:
                return
            job.seq_len = message.seq_len
            pages = max(1, -(-message.seq_len * self.lm.kv_bytes_per_token // self.page_bytes))
            try:
                self.prealloc.add(PreallocRequest(job.rid, job.room, pages, required_acks=1))
            except BadRequestError as exc:
                self._send(AbortRequest(job.rid, job.room, None))
                self._finish(job, DecodeStatus.FAILED, exc.message)
                return
            self._polls[job.rid] = KVPoll.WaitingForInput
            job.advance(DecodePhase.PREALLOC)
            return
        # TransferDone
        if job.phase is DecodePhase.WAITING:
            if not message.ok:
                self._finish(job, DecodeStatus.FAILED, message.error)
            return
        if job.phase in (DecodePhase.PREALLOC, DecodePhase.TRANSFER) and not job.aborted:
            if not message.ok:
                job.error = message.error
            self._polls[job.rid] = KVPoll.Success if message.ok else KVPoll.Failed

    def _failure(self, job: _Job, message: str) -> tuple[DecodeStatus, str]:
        if job.aborted:
            return DecodeStatus.ABORTED, "aborted"
        return DecodeStatus.FAILED, job.error or message

    def _on_sink_abort(self, req: DecodeRequest, message: str) -> None:
        job = self._jobs.get(req.rid)
        if job is not None and job.req is req:
            self._finish(job, *self._failure(job, message))

    def _on_commit(self, req: DecodeRequest, rope_delta: int, seq_len: int) -> None:
        job = self._jobs.get(req.rid)
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

    def _send(self, message: PrefillMessage) -> None:
        if self._prefill is None:
            raise ServiceUnavailableError("the decode worker is not connected to a prefill worker")
        self._prefill(message)

    def _finish(
        self, job: _Job, status: DecodeStatus, error: str = "", tokens: tuple[int, ...] = ()
    ) -> None:
        if job.phase is DecodePhase.DONE:
            return
        job.result = DecodeResult(
            rid=job.rid,
            status=status,
            tokens=tokens,
            error=error,
            checksum=job.checksum if status is DecodeStatus.COMPLETED else 0,
            started_at=job.started_at,
            first_token_at=job.first_token_at,
            finished_at=anyio.current_time(),
        )
        self._counts[status] += 1
        job.advance(DecodePhase.DONE)
        self._polls.pop(job.rid, None)
        if self._jobs.get(job.rid) is job:
            del self._jobs[job.rid]
        job.done.set()
        self._poke()

    # -- decoding ----------------------------------------------------------------------------

    async def _decode(self, job: _Job) -> None:
        req = job.req
        assert req is not None
        try:
            tokens = await run_thread_to_completion(
                self._decode_sync, job, req.pages, limiter=self._compute
            )
        except EncdisaggError as exc:
            self._finish(job, DecodeStatus.FAILED, exc.message)
        except Exception as exc:
            _log.exception("decoding request %r failed", job.rid)
            self._finish(job, DecodeStatus.FAILED, repr(exc))
        else:
            if job.aborted:
                self._finish(job, DecodeStatus.ABORTED, "aborted while decoding", tuple(tokens))
            else:
                self._finish(job, DecodeStatus.COMPLETED, tokens=tuple(tokens))
        finally:
            # The KV was committed: no writer is left, so the pages go back at once.
            self.sink.release(req)
            self._decoding -= 1
            self._poke()

    def _decode_sync(self, job: _Job, pages: tuple[int, ...]) -> list[int]:
        blob = torch.cat([self.pool.page(page) for page in pages])
        kv = self.lm.unpack_kv(blob, job.seq_len)
        return self.lm.decode(
            kv,
            first_token=job.first_token,
            rope_delta=job.rope_delta,
            max_new_tokens=job.max_new_tokens,
            should_stop=job.stop.is_set,
        )
