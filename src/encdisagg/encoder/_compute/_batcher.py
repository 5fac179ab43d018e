"""The batching scheduler: one task owns the model and fuses jobs into forwards."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..._errors import (
    EncdisaggError,
    InternalError,
    ServiceUnavailableError,
)
from ..._modality import Modality
from ...models import Preprocessed, VisionModel
from ...nurseries import run_thread_to_completion

__all__ = ["Batcher", "ForwardJob", "check_token_count", "forward_failure"]

_log = logging.getLogger("encdisagg.encoder")


def check_token_count(output: torch.Tensor, pre: Preprocessed, req_id: str) -> None:
    """:raises InternalError: (naming ``req_id``) if ``output`` has another row count than
    ``pre`` promised."""
    expected = sum(pre.token_counts)
    produced = int(output.shape[0]) if output.dim() >= 1 else 0
    if produced != expected:
        raise InternalError(
            f"Encoder produced {produced} tokens, but preprocessor metadata expected {expected}",
            req_id=req_id,
        )


def forward_failure(exc: Exception, req_id: str) -> EncdisaggError:
    """What the client sees when the model's forward raised ``exc``: ``exc`` itself if it is
    one of ours, else an :class:`~encdisagg.InternalError` whose cause is ``exc``."""
    if isinstance(exc, EncdisaggError):
        return exc
    error = InternalError(f"req_id {req_id!r}: the model's forward failed: {exc!r}", req_id=req_id)
    error.__cause__ = exc
    return error


@dataclass(eq=False, slots=True)
class ForwardJob:
    """One request's preprocessed input waiting for a forward.

    Written by the batcher, read by the request's encode job after ``done`` is set.
    """

    req_id: str
    modality: Modality
    pre: Preprocessed
    done: anyio.Event = field(default_factory=anyio.Event)
    output: torch.Tensor | None = None
    error: BaseException | None = None
    #: Set by the encode job when its caller left; the batcher then skips the job.
    abandoned: bool = False
    #: When the job entered the queue (``anyio.current_time()``), for the queue metric.
    queued_at: float = 0.0
    #: Called once, on the event loop, when the batcher is done with the job (run, skipped
    #: or failed): from then on nothing of the batcher's holds its inputs.
    on_finish: Callable[[], None] | None = None
    #: When the job's (fused) forward began and ended (span clock, ``time.time_ns``), and
    #: how many jobs it fused: read for a traced request's spans.
    forward_ns: tuple[int, int, int] | None = None

    def finish(self, output: torch.Tensor | None, error: BaseException | None) -> None:
        self.output = output
        self.error = error
        self.done.set()
        on_finish, self.on_finish = self.on_finish, None
        if on_finish is not None:
            on_finish()


class Batcher:
    """Collects :class:`ForwardJob`s and runs them through the model in batches.

    Jobs of one modality are fused up to ``max_batch_size``; the forward runs in a worker
    thread that is never abandoned (cancelling the batcher waits for it). If a fused
    forward raises, its jobs are retried one at a time, so one bad input does not fail its
    batch-mates; a job whose output has the wrong row count fails alone.
    """

    def __init__(
        self,
        model: VisionModel,
        *,
        max_batch_size: int,
        max_queued_jobs: int,
        on_batch: Callable[[int, float], None] | None = None,
        on_queue: Callable[[float], None] | None = None,
    ) -> None:
        self._model = model
        self._max_batch_size = max_batch_size
        send, receive = anyio.create_memory_object_stream[ForwardJob](max_queued_jobs)
        self._send: MemoryObjectSendStream[ForwardJob] = send
        self._receive: MemoryObjectReceiveStream[ForwardJob] = receive
        self._on_batch = on_batch
        self._on_queue = on_queue
        self._forward_limiter = anyio.CapacityLimiter(1)

    async def submit(self, job: ForwardJob) -> None:
        """Queue ``job``; a checkpoint. Waits while the queue is full (bound it with
        ``anyio.fail_after``).

        :raises ServiceUnavailableError: if the batcher has stopped.
        """
        job.queued_at = anyio.current_time()
        try:
            await self._send.send(job)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise ServiceUnavailableError(
                "the encoder is shutting down", req_id=job.req_id
            ) from None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve jobs until cancelled; a checkpoint. Jobs left in the queue then fail with
        503 (their ``on_finish`` runs), and later submits are refused."""
        task_status.started()
        try:
            async for first in self._receive:
                batch = [first]
                while len(batch) < self._max_batch_size:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except anyio.WouldBlock:
                        break
                await self._run_batch(batch)
        finally:
            self.close()

    def close(self) -> None:
        """Refuse new jobs and fail the queued ones (503). Idempotent; not a checkpoint. For
        a batcher whose :meth:`run` never started (it does the same when it ends)."""
        # Closing the sending side first refuses new submits; the receiving side is closed
        # only once drained, since a closed one gives nothing back.
        self._send.close()
        try:
            while True:
                try:
                    job = self._receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    return
                job.finish(
                    None,
                    ServiceUnavailableError("the encoder is shutting down", req_id=job.req_id),
                )
        finally:
            self._receive.close()

    async def _run_batch(self, batch: Sequence[ForwardJob]) -> None:
        try:
            by_modality: dict[Modality, list[ForwardJob]] = {}
            for job in batch:
                if job.abandoned:
                    job.finish(None, None)
                    continue
                by_modality.setdefault(job.modality, []).append(job)
            for group in by_modality.values():
                if self._on_queue is not None:
                    now = anyio.current_time()
                    for job in group:
                        self._on_queue(now - job.queued_at)
                await self._forward_group(group)
        finally:
            # Cancelled mid-batch (shutdown): nobody may wait for a job that will never run.
            for job in batch:
                if not job.done.is_set():
                    job.finish(None, ServiceUnavailableError("the encoder is shutting down"))

    async def _forward_group(self, group: list[ForwardJob]) -> None:
        started_ns = time.time_ns()
        try:
            outputs = await self._forward([job.pre for job in group])
        except Exception as exc:
            if len(group) == 1:
                group[0].finish(None, forward_failure(exc, group[0].req_id))
                return
            _log.warning(
                "fused forward of %d requests failed (%r); retrying one at a time",
                len(group),
                exc,
            )
            for job in group:
                if job.abandoned:
                    job.finish(None, None)
                    continue
                await self._forward_group([job])
            return
        forward_ns = (started_ns, time.time_ns(), len(group))
        for job in group:
            job.forward_ns = forward_ns
        if len(outputs) != len(group):
            error = InternalError(
                f"the model returned {len(outputs)} outputs for a batch of {len(group)}"
            )
            for job in group:
                job.finish(None, error)
            return
        for job, output in zip(group, outputs, strict=True):
            try:
                check_token_count(output, job.pre, job.req_id)
            except InternalError as exc:
                job.finish(None, exc)
            else:
                job.finish(output, None)

    async def _forward(self, batch: list[Preprocessed]) -> list[torch.Tensor]:
        start = anyio.current_time()
        outputs = await run_thread_to_completion(
            self._model.forward, batch, limiter=self._forward_limiter
        )
        if self._on_batch is not None:
            self._on_batch(len(batch), anyio.current_time() - start)
        return outputs
