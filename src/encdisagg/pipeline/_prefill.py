"""The prefill worker: embeddings from the encoders, prefill, KV into decode's memory.

Per request, in its caller's task (:meth:`PrefillWorker.prefill`):

1. fetch the image embeddings (:func:`~encdisagg.receiver.fetch_embeddings`);
2. build the prompt around them and run prefill in a worker thread (the embeddings are
   copied into the model's input there, so the landing memory is free right after);
3. pack the KV into staging pages registered with this worker's engine, and tell decode the
   prompt length (:class:`BootstrapInfo`);
4. wait for decode's pages (:class:`KVDestination`), write every page and then the metadata
   row (its room tag last), in a worker thread that is never abandoned;
5. report (:class:`TransferDone`), or, if decode aborted, stop between pages and send the
   drained-ack of the abort's generation once the last write returned.

The staging pages and row are owned by the request's call and freed when it returns, which is
after every write that reads them ended. Packing and writing live in :mod:`._kv_writer`, what
an abort does to a request in :mod:`._prefill_types`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final

import anyio
import anyio.lowlevel

from .. import _tracing
from .._errors import (
    EncdisaggError,
    InternalError,
    RequestNotActiveError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from .._modality import Modality
from ..nurseries import run_thread_to_completion
from ..receiver import EmbeddingReceiver, EncoderClient, fetch_embeddings
from ._kv_writer import KVPageWriter, StagedKV
from ._lm import LanguageModel, PrefillResult
from ._pd_messages import (
    BootstrapInfo,
    DecodeMessage,
    DrainedAck,
    KVDestination,
    PrefillMessage,
    TransferDone,
)
from ._prefill_types import (
    AbortTombstones,
    PipelineRequest,
    PrefillJob,
    PrefillReport,
    PrefillStats,
    PrefillStatus,
)

if TYPE_CHECKING:
    from ..transfer import TransferEngine

__all__ = ["PrefillWorker"]

_log = logging.getLogger("encdisagg.pipeline")

#: A traced request's prefill (its embeddings fetched, the forward, the KV written), and
#: the KV write to decode inside it.
PREFILL_SPAN: Final = "encdisagg.prefill"
KV_WRITE_SPAN: Final = "encdisagg.kv_write"


class PrefillWorker(anyio.AsyncContextManagerMixin):
    """Runs prefill for requests and writes their KV into a decode worker's memory.

    ``async with PrefillWorker(...) as prefill:`` registers the staging pages and rows with
    ``engine``; leaving deregisters them, after the requests still running (in their callers'
    tasks) returned (shielded wait, bounded by ``close_timeout_s``). The
    :class:`~encdisagg.receiver.EncoderClient` and
    :class:`~encdisagg.receiver.EmbeddingReceiver` must be open while requests run.

    :param lm: the language model (its own instance).
    :param client: reaches the encoders.
    :param receiver: where embeddings land.
    :param engine: writes the KV (Loopback or Mooncake, the decode side's kind).
    :param page_bytes: KV page size; must equal the decode worker's.
    :param staging_pages: staging pages (KV of requests between prefill and write).
    :param staging_rows: staging metadata rows.
    :param rank: this worker's prefill rank (named in its acks).
    :param fetch_timeout_s: bound on getting a request's embeddings.
    :param destination_timeout_s: bound on waiting for decode's pages.
    :param staging_timeout_s: bound on waiting for staging pages.
    """

    def __init__(
        self,
        lm: LanguageModel,
        *,
        client: EncoderClient,
        receiver: EmbeddingReceiver,
        engine: TransferEngine,
        page_bytes: int,
        staging_pages: int = 512,
        staging_rows: int = 64,
        rank: int = 0,
        fetch_timeout_s: float = 120.0,
        destination_timeout_s: float = 120.0,
        staging_timeout_s: float = 60.0,
        close_timeout_s: float = 30.0,
    ) -> None:
        self.lm = lm
        self.client = client
        self.receiver = receiver
        self.engine = engine
        self.rank = rank
        self.page_bytes = page_bytes
        self._writer = KVPageWriter(
            lm,
            engine,
            page_bytes=page_bytes,
            staging_pages=staging_pages,
            staging_rows=staging_rows,
            staging_timeout_s=staging_timeout_s,
        )
        self.staging = self._writer.staging
        self.rows = self._writer.rows
        self.row_slots = self._writer.row_slots
        self._fetch_timeout_s = fetch_timeout_s
        self._destination_timeout_s = destination_timeout_s
        self._close_timeout_s = close_timeout_s
        self._decode: Callable[[DecodeMessage], None] | None = None
        self._jobs: dict[int, PrefillJob] = {}
        self._tombstones = AbortTombstones()
        self._idle = anyio.Event()
        self._compute = anyio.CapacityLimiter(1)
        self._open = False
        #: Drained-acks sent (each after its request's last write).
        self.acks_sent = 0
        self._counts = dict.fromkeys(PrefillStatus, 0)
        self._writes_stopped = 0

    # -- wiring ------------------------------------------------------------------------------

    def connect(self, deliver: Callable[[DecodeMessage], None]) -> None:
        """Where messages for the decode side go (synchronous, must not block)."""
        self._decode = deliver

    def deliver(self, message: PrefillMessage) -> None:
        """A message from decode. Synchronous; never blocks."""
        job = self._jobs.get(message.room)
        if job is not None and job.request.rid != message.rid:
            job = None  # another request's room
        if isinstance(message, KVDestination):
            if job is not None and not job.aborted:
                job.destination = message
                job.destination_ready.set()
        elif job is not None:
            job.abort(message.generation)
        elif message.generation is not None:
            # Nothing of that request is in flight here: the drain is over already.
            self._send(DrainedAck(message.room, self.rank, message.generation))
            self.acks_sent += 1
        else:
            # It may not have started here yet: remember, bounded.
            self._tombstones.remember(message.room)

    def _send(self, message: DecodeMessage) -> None:
        if self._decode is None:
            raise ServiceUnavailableError("the prefill worker is not connected to a decode worker")
        self._decode(message)

    # -- lifecycle ---------------------------------------------------------------------------

    def stats(self) -> PrefillStats:
        return PrefillStats(
            live=len(self._jobs),
            done=self._counts[PrefillStatus.DONE],
            aborted=self._counts[PrefillStatus.ABORTED],
            failed=self._counts[PrefillStatus.FAILED],
            writes_stopped=self._writes_stopped,
            acks_sent=self.acks_sent,
            staging_pages_free=self.staging.available(),
            staging_pages=self.staging.num_pages,
            staging_rows_free=self.row_slots.available(),
            staging_rows=self.rows.size,
        )

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[PrefillWorker]:
        if self._open:
            raise RuntimeError("a PrefillWorker is entered once at a time")
        async with self.staging.registered(self.engine), self.rows.registered(self.engine):
            self._open = True
            try:
                yield self
            finally:
                self._open = False
                for job in list(self._jobs.values()):
                    job.abort(None)
                if self._jobs:
                    self._idle = anyio.Event()
                    with anyio.move_on_after(self._close_timeout_s, shield=True):
                        await self._idle.wait()

    # -- one request -------------------------------------------------------------------------

    async def prefill(self, request: PipelineRequest) -> PrefillReport:
        """Run ``request`` through prefill and write its KV to decode. A checkpoint.

        Returns once nothing of the request is being written any more: done, aborted by
        decode (its drain acked), or failed (decode told). Cancelling the caller acts like an
        abort from decode without a generation: decode is told the request failed.

        :raises RequestNotActiveError: the room is in use by a running request.
        :raises ServiceUnavailableError: the worker is not running.
        """
        await anyio.lowlevel.checkpoint()
        if not self._open:
            raise ServiceUnavailableError("the prefill worker is not running", req_id=request.rid)
        room = request.room
        if room in self._jobs:
            raise RequestNotActiveError(f"room {room} is in use", req_id=request.rid)
        job = PrefillJob(request)
        self._jobs[room] = job
        if self._tombstones.forget(room):
            job.abort(None)
        report = PrefillReport(request.rid, PrefillStatus.FAILED, "not run")
        try:
            with _tracing.span(_tracing.current(), PREFILL_SPAN, {"encdisagg.rid": request.rid}):
                report = await self._run(job)
        finally:
            # Synchronous from here: no write is in flight, and the ack goes out before any
            # other abort for this room can be handled.
            del self._jobs[room]
            if job.aborted and job.generation is not None:
                self._send(DrainedAck(room, self.rank, job.generation))
                self.acks_sent += 1
            elif report.status is PrefillStatus.FAILED:
                self._send(TransferDone(request.rid, room, self.rank, ok=False, error=report.error))
            self._counts[report.status] += 1
            if not self._jobs:
                self._idle.set()
        return report

    async def _run(self, job: PrefillJob) -> PrefillReport:
        request = job.request
        staged: StagedKV | None = None
        try:
            with job.scope:
                result = await self._embed_and_prefill(job)
                staged = await self._writer.stage(request, result)
                self._send(BootstrapInfo(request.rid, request.room, result.seq_len, self.rank))
                destination = await self._wait_destination(job)
                self._writer.check_destination(destination, staged)
                # From here on an abort only stops the writer between pages.
                job.writing = True
            if job.aborted or staged is None:
                return self._report(job, PrefillStatus.ABORTED)
            with _tracing.span(_tracing.current(), KV_WRITE_SPAN):
                wrote_all = await run_thread_to_completion(
                    self._writer.write, staged, job.destination, job.stop
                )
            job.times["written"] = anyio.current_time()
            if not wrote_all:
                self._writes_stopped += 1
                return self._report(job, PrefillStatus.ABORTED)
            self._send(TransferDone(request.rid, request.room, self.rank, ok=True))
            return self._report(job, PrefillStatus.DONE, staged.checksum)
        except EncdisaggError as exc:
            if job.aborted:
                return self._report(job, PrefillStatus.ABORTED)
            _log.warning("prefill of request %r failed: %s", request.rid, exc)
            return self._report(job, PrefillStatus.FAILED, error=str(exc))
        finally:
            job.writing = False
            if staged is not None:
                self._writer.unstage(staged)

    async def _embed_and_prefill(self, job: PrefillJob) -> PrefillResult:
        request = job.request
        lm = self.lm
        if not request.images:
            ids = lm.prompt_ids(request.prompt, ())
            result = await run_thread_to_completion(
                lm.prefill, ids, None, (), limiter=self._compute
            )
        else:
            items: dict[Modality | str, Sequence[object]] = {Modality.IMAGE: request.images}
            async with fetch_embeddings(
                self.client, self.receiver, request.rid, items, timeout_s=self._fetch_timeout_s
            ) as embeddings:
                job.times["embedded"] = anyio.current_time()
                images = embeddings.of(Modality.IMAGE)
                if images is None:
                    raise InternalError(f"request {request.rid!r}: no image embeddings came back")
                ids = lm.prompt_ids(request.prompt, images.token_counts)
                # The thread copies the embeddings into the model's input: the landing memory
                # is free again once this block ends.
                result = await run_thread_to_completion(
                    lm.prefill, ids, images.tensor, images.grid, limiter=self._compute
                )
            job.image_tokens = images.token_counts
        job.times["prefilled"] = anyio.current_time()
        job.result = result
        return result

    async def _wait_destination(self, job: PrefillJob) -> KVDestination:
        try:
            with anyio.fail_after(self._destination_timeout_s):
                await job.destination_ready.wait()
        except TimeoutError:
            raise RequestTimeoutError(
                f"request {job.request.rid!r}: decode gave no KV pages within "
                f"{self._destination_timeout_s} s",
                req_id=job.request.rid,
            ) from None
        assert job.destination is not None
        return job.destination

    def _report(
        self, job: PrefillJob, status: PrefillStatus, checksum: int = 0, *, error: str = ""
    ) -> PrefillReport:
        result = job.result
        return PrefillReport(
            rid=job.request.rid,
            status=status,
            error=error or ("aborted by decode" if status is PrefillStatus.ABORTED else ""),
            seq_len=0 if result is None else result.seq_len,
            first_token=0 if result is None else result.first_token,
            checksum=checksum,
            image_tokens=job.image_tokens,
            started_at=job.started_at,
            embedded_at=job.times.get("embedded"),
            prefilled_at=job.times.get("prefilled"),
            written_at=job.times.get("written"),
        )
