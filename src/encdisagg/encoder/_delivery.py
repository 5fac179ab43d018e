"""Delivery: one staged embedding to one destination (a Mooncake write or a ZMQ push).

A push's header frame is chosen by its destination: our msgpack header, or the one an
:class:`SglangZmqDestination` carries (SGLang's pickled ``EmbeddingData``).

Callers run these inside a job of the request (``_table``), so the staged memory outlives
every call here. A Mooncake write is one engine call: awaited on the event loop when the
engine has a ``write_async`` (``MooncakeEngine``), inline when the engine says it does not
block, else one worker-thread call that is never abandoned. A ZMQ push returns only once
ZMQ no longer references the payload.

A transfer that ends with an unknown outcome (the engine raised
:class:`~encdisagg.TransferTimeoutError`; ZMQ kept the payload after the push gave up)
leaves a hold on the staged memory before the error leaves here: the record's free then
waits for that hold (``_staging/_held``).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import anyio

from .. import _tracing
from .._errors import TransferError, TransferTimeoutError
from ..nurseries import run_thread_to_completion
from ..transfer import (
    EmbeddingHeader,
    EmbeddingLayout,
    EngineOptions,
    Hold,
    ZmqPushPool,
    payload_view,
)
from ..transfer._wire import ForeignHeader
from ._jobs import Job
from ._staging._owner import RegionOwner
from ._staging._staged import Staged
from ._table import Phase, RequestRecord
from ._types import Destination, MooncakeDestination, SglangZmqDestination, ZmqDestination

__all__ = ["Delivery"]


class Delivery:
    """Moves staged embeddings out.

    :param regions: the region owner (engine calls and per-send registrations).
    :param zmq: the pool of ZMQ push sockets.
    :param layout: the model's embedding layout (its ``embedding_layout``, e.g. Qwen3-VL's
        deepstack sections), sent in every data part's header; ``None``: one section.
    """

    def __init__(
        self, regions: RegionOwner, zmq: ZmqPushPool, *, layout: EmbeddingLayout | None = None
    ) -> None:
        self._regions = regions
        self._zmq = zmq
        self._layout = layout
        # Looked up once: the engine is the region owner's for its whole life.
        self._write_async = EngineOptions.of(regions.engine).write_async

    async def deliver(self, job: Job, destination: Destination) -> None:
        """Write into a Mooncake destination, or push to a ZMQ one."""
        if isinstance(destination, MooncakeDestination):
            await self.write(job, destination)
        else:
            await self.push(job, destination)

    async def write(self, job: Job, destination: MooncakeDestination) -> None:
        """Write the staged embedding into ``destination``'s registered buffer.

        :raises TransferError: the engine or the peer failed the write.
        :raises TransferTimeoutError: its outcome is unknown; the memory is held.
        """
        record = job.record
        staged: Staged = record.staged
        try:
            await self._write(job, staged, destination)
        except TransferTimeoutError as exc:
            # The write may still read the memory: hold it before the job can end.
            hold = _hold_of(exc, record.req_id, staged)
            self._regions.hold(staged, hold)
            req_id = record.req_id
            raise TransferTimeoutError(
                f"req_id {req_id!r}: {exc.message}", req_id=req_id, hold=hold
            ) from exc
        except TransferError as exc:
            if exc.req_id is None:
                exc.req_id = record.req_id
            raise

    async def _write(self, job: Job, staged: Staged, destination: MooncakeDestination) -> None:
        record = job.record
        regions = self._regions
        engine = regions.engine
        if engine is None:
            raise TransferError(
                f"req_id {record.req_id!r}: a Mooncake destination needs transfer='mooncake'",
                req_id=record.req_id,
            )
        if not staged.transferable:
            # Per-send registration: one at a time per record, so the same pointer is never
            # registered twice at once. A registration left behind by a failed
            # deregistration is the record's own from then on, and the next send reuses it.
            if record.fallback_lock is None:
                record.fallback_lock = anyio.Lock()
            with job.waiting():
                async with record.fallback_lock:
                    # Read again under the lock: the send before may have left a
                    # registration behind.
                    if not staged.transferable:
                        await regions.call(
                            regions.write_with_own_registration,
                            staged,
                            destination.session_id,
                            destination.buffer_address,
                            record.req_id,
                        )
                        return
        write = (destination.session_id, staged.ptr, destination.buffer_address, staged.nbytes)
        write_async = self._write_async
        if write_async is not None:
            # The engine waits for its own write on the event loop (MooncakeEngine), no
            # worker thread per write; a cancellation takes effect once the write ended or
            # outlived the engine's bound.
            with job.waiting():
                await write_async(*write)
            return
        if not regions.blocking:
            engine.write(*write)
            return
        # One worker-thread call, never abandoned: a cancellation takes effect once the
        # engine stopped reading the memory, or gave up waiting for it.
        with job.waiting():
            await regions.call(engine.write, *write)

    async def push(self, job: Job, destination: ZmqDestination) -> None:
        """Push the embedding (or the request's error part) to a ZMQ PULL endpoint."""
        record = job.record
        header: EmbeddingHeader | ForeignHeader
        if isinstance(destination, SglangZmqDestination):
            header = ForeignHeader(record.req_id, record.request.part_idx, destination.header)
        else:
            header = _header(record, self._layout)
            if record.trace is not None:
                # The receiver's spans continue the trace of this push (its transfer span).
                parent = _tracing.current_traceparent()
                if parent is None:
                    parent = record.trace.traceparent()
                header = dataclasses.replace(header, traceparent=parent)
        url = destination.url
        payload = None
        on_still_held = None
        if record.phase is not Phase.FAILED:
            staged: Staged = record.staged
            payload = staged.host_bytes()
            if payload is None:
                tensor = staged.tensor
                if tensor.device.type != "cpu":
                    # A device-to-host copy waits for the device: never on the event loop.
                    tensor = await run_thread_to_completion(tensor.cpu)
                payload = payload_view(tensor)
            on_still_held = partial(self._regions.hold, staged)
        if self._zmq.send_nowait(url, header, payload):
            # Copied into ZMQ's queue: nothing of ours is referenced any more.
            return
        # Returns only once ZMQ no longer references the payload (if it does not let go,
        # the staged memory is held until it does).
        with job.waiting():
            await self._zmq.send(url, header, payload, on_still_held=on_still_held)


def _hold_of(error: TransferTimeoutError, req_id: str, staged: Staged) -> Hold:
    """The engine's hold on the memory; an engine that gave none can never say the write
    ended, so the memory is held for good."""
    if isinstance(error.hold, Hold):
        return error.hold
    return Hold(f"req_id {req_id!r}: {staged.nbytes} bytes at {staged.ptr:#x}", staged.nbytes)


def _header(record: RequestRecord, layout: EmbeddingLayout | None = None) -> EmbeddingHeader:
    """The push header: the embedding's layout, or an error part (no payload)."""
    request = record.request
    error = record.error if record.phase is Phase.FAILED else None
    # An error part describes no embedding, even when its metadata was published.
    result = record.metadata if error is None else None
    assert error is not None or result is not None
    return EmbeddingHeader(
        req_id=record.req_id,
        num_parts=request.num_parts,
        part_idx=request.part_idx,
        modality=request.kind.value,
        shape=(0, 0) if result is None else (result.num_tokens, result.hidden_size),
        dtype="float16" if result is None else result.dtype,
        token_counts=() if result is None else result.token_counts,
        grid=() if result is None else result.grid,
        video_timing=None if result is None else result.video_timing,
        error=None if error is None else error.message,
        status=None if error is None else error.status,
        layout=layout if error is None else None,
    )
