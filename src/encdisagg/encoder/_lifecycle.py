"""The request lifecycle: encode, send, push, wait, release, expire.

Work that may touch a request's staged memory runs inside a :class:`~._jobs.Job`, so
*drain before free* holds by construction (``_jobs``); a record no job holds is freed by
its release. Transfers inside a job are worker-thread calls that are never abandoned (or
calls that do not block at all), so a cancelled job leaves only after its transfer stopped
touching memory.

The jobs run in their callers' tasks; the Encoder-initiated ones (pushes to registered
destinations) run in the Encoder's own push task group. Deadlines are kept by one task
(``_deadlines``) that only ever cancels jobs and marks records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import anyio
import anyio.lowlevel
import torch

from .. import _tracing
from .._config import EncoderConfig
from .._errors import (
    BadRequestError,
    EncdisaggError,
    InternalError,
    RequestNotActiveError,
    RequestTimeoutError,
    TransferTimeoutError,
)
from .._numbers import whole
from ..models import Preprocessed
from ..nurseries import KeyedWakeups, ServiceTaskGroup, loop_checkpoint, loop_clock
from ._compute._path import ComputePath
from ._compute._traced import ENCODE_SPAN, STAGE_SPAN, encode_attributes, transfer_span
from ._deadlines import DeadlineKeeper
from ._delivery import Delivery
from ._events import EncoderEvents
from ._jobs import CutShort, Job
from ._staging._budget import StagedBudget
from ._staging._owner import RegionOwner
from ._table import Phase, RequestRecord, RequestTable, released
from ._types import Destination, EncodeRequest, EncodeResult, ZmqDestination

__all__ = ["RequestLifecycle"]

T = TypeVar("T")

_log = logging.getLogger("encdisagg.encoder")

_STATUS_BY_HTTP = {400: "bad_request", 503: "unavailable"}


def _error_copy(error: EncdisaggError) -> EncdisaggError:
    # One exception object must not be raised in several tasks (tracebacks pile up).
    copy = type(error)(error.message, req_id=error.req_id)
    copy.__cause__ = error.__cause__
    return copy


def _check_receive_count(req_id: str, receive_count: object) -> None:
    whole("receive_count", receive_count, least=1, error=partial(BadRequestError, req_id=req_id))


class RequestLifecycle:
    """The Encoder's requests: their table, jobs, deadlines and delivery."""

    def __init__(
        self,
        config: EncoderConfig,
        *,
        compute: ComputePath,
        regions: RegionOwner,
        budget: StagedBudget,
        delivery: Delivery,
        events: EncoderEvents,
        pushes: ServiceTaskGroup,
    ) -> None:
        self.config = config
        # The loop's clock, read without AnyIO's backend lookup on every call.
        self._now = now = loop_clock()
        #: The loop's checkpoint, for the Encoder's methods (each one is a checkpoint).
        self.checkpoint = loop_checkpoint()
        self.table = RequestTable(
            now,
            remember_s=config.request_timeout_s,
            abandon_ttl_s=config.abandon_ttl_s,
        )
        self.wakeups: KeyedWakeups[str] = KeyedWakeups()
        self.deadlines = DeadlineKeeper(self.expire, lambda: len(self.table))
        self._compute = compute
        self._regions = regions
        self._budget = budget
        self._delivery = delivery
        self._events = events
        self._pushes = pushes
        #: Set once no request is live, after :func:`~._shutdown.drain` armed it.
        self.all_freed: anyio.Event | None = None
        self.inflight = 0
        model = compute.model
        #: The embedding layout every result has: hidden size, dtype name, item size.
        self._layout = (
            model.hidden_size,
            str(model.dtype).removeprefix("torch."),
            model.dtype.itemsize,
        )

    # -- synchronous decisions --------------------------------------------------------------

    def free(self, record: RequestRecord) -> None:
        """The record's last job left after release was asked for: free its memory."""
        staged, record.staged = record.staged, None
        if staged is not None:
            record.handover = self._regions.free(record.req_id, staged)
        self.table.retire(record)
        self.wakeups.wake(record.req_id)
        if self.all_freed is not None and not self.table.live:
            self.all_freed.set()

    def request_release(self, record: RequestRecord) -> None:
        if record.request_release():
            self.free(record)

    def expire(self, record: RequestRecord) -> None:
        """The request's own deadline passed: stop its jobs; the last one frees it."""
        if record.retired or record.phase is not Phase.STAGED:
            return
        record.expired = True
        record.cancel_jobs()
        self.request_release(record)

    def _publish_metadata(self, record: RequestRecord, pre: Preprocessed) -> None:
        num_tokens = sum(pre.token_counts)
        hidden, dtype, itemsize = self._layout
        record.metadata = EncodeResult(
            req_id=record.req_id,
            num_tokens=num_tokens,
            hidden_size=hidden,
            dtype=dtype,
            nbytes=num_tokens * hidden * itemsize,
            # Preprocessed stores both as tuples of ints already.
            token_counts=pre.token_counts,
            grid=pre.grid,
            video_timing=pre.video_timing,
        )
        self.wakeups.wake(record.req_id)

    def _fail(self, record: RequestRecord, error: EncdisaggError) -> None:
        record.phase = Phase.FAILED
        record.error = error
        record.release_requested = True
        try:
            self.wakeups.wake(record.req_id)
        except Exception:
            _log.exception("publishing the error of req_id %r failed", record.req_id)
        for url in record.push_urls:
            self._start_push(record, url)

    def _fix_receive_count(self, record: RequestRecord, receive_count: int | None) -> None:
        if receive_count is None:
            return
        req_id = record.req_id
        _check_receive_count(req_id, receive_count)
        if record.receive_count is not None and record.receive_count != receive_count:
            raise BadRequestError(
                f"receive_count {receive_count} differs from the {record.receive_count} "
                f"registered first for req_id {req_id!r}",
                req_id=req_id,
            )
        record.receive_count = receive_count

    # -- encode -------------------------------------------------------------------------------

    async def encode(self, request: EncodeRequest) -> EncodeResult:
        self._budget.check_admission(request.req_id)
        record = self.table.admit(request)
        self.wakeups.wake(request.req_id)
        on_done = self._events.on_request_done
        started = 0.0 if on_done is None else self._now()
        status = "error"
        # Captured once: None (nothing else to pay) unless a tracer provider is set.
        trace = _tracing.current()
        try:
            with Job(record, self.free) as job:
                try:
                    if trace is None:
                        result = await self._encode_job(job)
                    else:
                        # Sends and pushes of the request, later and from other tasks, hang
                        # under its encode span too.
                        with trace.span(ENCODE_SPAN, encode_attributes(request)) as record.trace:
                            result = await self._encode_job(job)
                except CutShort:
                    record.phase = Phase.ABORTED
                    raise RequestNotActiveError(
                        f"req_id {request.req_id!r} ended during its encode",
                        req_id=request.req_id,
                    ) from None
                except EncdisaggError as exc:
                    if exc.req_id is None:
                        exc.req_id = record.req_id
                    status = _STATUS_BY_HTTP.get(exc.status, "error")
                    self._fail(record, exc)
                    raise
                except Exception as exc:
                    internal = InternalError(
                        f"req_id {record.req_id!r}: encoding failed: {exc!r}",
                        req_id=record.req_id,
                    )
                    self._fail(record, internal)
                    raise internal from exc
                except BaseException:
                    if record.phase is Phase.ENCODING:
                        record.phase = Phase.ABORTED
                    raise
            status = "ok"
            return result
        finally:
            if on_done is not None:
                on_done(request.kind.value, status, self._now() - started)

    async def _encode_job(self, job: Job) -> EncodeResult:
        record = job.record
        request = record.request
        compute = self._compute
        # A partial, not a closure: nothing per request to build beyond one C object.
        on_preprocessed = partial(self._publish_metadata, record)
        trace = record.trace
        if compute.inline and trace is None:
            rows, from_cache = compute.run_inline(request, on_preprocessed)
        else:
            with job.waiting():
                rows, _, from_cache = await compute.run(request, on_preprocessed, trace)
        metadata = record.metadata
        assert metadata is not None
        if rows.shape != (metadata.num_tokens, metadata.hidden_size) or (
            rows.dtype != compute.model.dtype
        ):
            raise InternalError(
                f"req_id {record.req_id!r}: the model produced {list(rows.shape)} {rows.dtype}, "
                f"but its preprocessing promised {[metadata.num_tokens, metadata.hidden_size]} "
                f"{metadata.dtype}",
                req_id=record.req_id,
            )
        if rows.requires_grad:
            rows = rows.detach()
        if trace is None:
            await self._stage(record, rows, from_cache)
        else:
            with trace.span(STAGE_SPAN):
                await self._stage(record, rows, from_cache)
        record.phase = Phase.STAGED
        record.deadline = self._now() + self.config.send_timeout_s
        self.deadlines.add(record)
        self.wakeups.wake(record.req_id)
        for url in record.push_urls:
            self._start_push(record, url)
        return metadata

    async def _stage(self, record: RequestRecord, rows: torch.Tensor, from_cache: bool) -> None:
        staged = self._regions.stage(record.req_id, rows, copy=from_cache)
        record.staged = staged
        if staged.is_cuda:
            # The forward and the copy into the arena may still be queued on the device:
            # no transfer may read the memory before they finished.
            await self._regions.device_finished(staged)
        if not staged.transferable:
            await self._regions.register_own(record.req_id, staged)

    # -- send and push ------------------------------------------------------------------------

    async def send(self, req_id: str, destination: Destination, receive_count: int | None) -> None:
        record = self.table.lookup(req_id)
        self._fix_receive_count(record, receive_count)
        try:
            with Job(record, self.free) as job:
                await self._deliver(job, destination)
        except CutShort:
            if record.expired:
                raise RequestTimeoutError(
                    f"req_id {req_id!r} was not delivered within send_timeout_s="
                    f"{self.config.send_timeout_s} and was released",
                    req_id=req_id,
                ) from None
            raise released(req_id) from None
        except Exception:
            # A failed send released the request: the caller sees it gone.
            await self.settle(record)
            raise
        if record.release_requested:
            # This send completed the delivery (or a release is pending): the caller
            # sees the request gone, within the cleanup bound.
            await self.settle(record)

    async def _deliver(self, job: Job, destination: Destination) -> None:
        record = job.record
        if record.phase is Phase.ENCODING:
            with job.waiting():
                await self._wait_for(
                    record.req_id,
                    lambda: record.phase is not Phase.ENCODING or None,
                    "req_id {req_id!r} was not staged within",
                )
        if record.phase is not Phase.STAGED:
            if record.error is not None:
                raise _error_copy(record.error)
            raise released(record.req_id)
        identity = destination.identity
        if record.release_requested and identity not in record.delivered:
            raise released(record.req_id)
        start = self._now() if self._events.on_phase is not None else 0.0
        self.inflight += 1
        try:
            if record.trace is None:
                await self._delivery.deliver(job, destination)
            else:
                with transfer_span(record.trace, destination):
                    await self._delivery.deliver(job, destination)
        finally:
            self.inflight -= 1
        if self._events.on_phase is not None:
            self._events.phase("transfer", self._now() - start)
        record.note_delivered(identity, self.config.default_receive_count)

    async def _wait_for(self, req_id: str, outcome: Callable[[], T | None], timed_out: str) -> T:
        """Park on ``req_id`` until ``outcome()`` gives a value (or raises), at most
        ``request_timeout_s``. Waiting or timing out leaves no state.

        :raises RequestTimeoutError: ``timed_out`` (formatted with ``req_id``) and the bound.
        """
        timeout = self.config.request_timeout_s
        try:
            with anyio.fail_after(timeout):
                while (value := outcome()) is None:
                    await self.wakeups.park(req_id)
                return value
        except TimeoutError:
            message = timed_out.format(req_id=req_id)
            raise RequestTimeoutError(f"{message} {timeout} s", req_id=req_id) from None

    def _start_push(self, record: RequestRecord, url: str) -> None:
        job = Job(record, self.free)
        try:
            self._pushes.start_soon(self._push, job, url, name=f"push {record.req_id}")
        except RuntimeError:
            job.leave()
            _log.warning("req_id %r: not pushing to %s, the encoder is closing", record.req_id, url)

    async def _push(self, job: Job, url: str) -> None:
        record = job.record
        try:
            with job:
                if record.phase is Phase.FAILED:
                    await self._delivery.push(job, ZmqDestination(url))
                else:
                    await self._deliver(job, ZmqDestination(url))
        except CutShort:
            _log.warning("req_id %r: the push to %s was cut short", record.req_id, url)
        except Exception as exc:
            _log.error("req_id %r: pushing to %s failed", record.req_id, url, exc_info=exc)

    async def register_destinations(
        self, req_id: str, receive_count: int, urls: list[str] | tuple[str, ...]
    ) -> None:
        if not isinstance(urls, (list, tuple)) or not urls:
            raise BadRequestError("receive_url must be a non-empty list of URLs", req_id=req_id)
        destinations = [ZmqDestination(url) for url in urls]
        _check_receive_count(req_id, receive_count)

        def live() -> RequestRecord | None:
            found = self.table.get(req_id)
            if found is None and self.table.ended(req_id):
                raise released(req_id)
            return found

        # Waits (bounded) for the encode to create the record; waiting creates no state.
        record = await self._wait_for(req_id, live, "req_id {req_id!r} did not appear within")
        if record.release_requested:
            raise RequestNotActiveError(f"req_id {req_id!r} is being released", req_id=req_id)
        self._fix_receive_count(record, receive_count)
        for destination in destinations:
            if destination.url in record.push_urls:
                continue
            record.push_urls.append(destination.url)
            if record.phase is Phase.STAGED:
                self._start_push(record, destination.url)

    # -- metadata, release --------------------------------------------------------------------

    async def wait_metadata(self, req_id: str) -> EncodeResult:
        def published() -> EncodeResult | None:
            record = self.table.get(req_id)
            if record is not None:
                if record.error is not None:
                    raise _error_copy(record.error)
                if record.phase is Phase.ABORTED and record.metadata is None:
                    raise released(req_id)
                return record.metadata
            if self.table.ended(req_id):
                error = self.table.ended_error(req_id)
                raise released(req_id) if error is None else _error_copy(error)
            return None

        return await self._wait_for(req_id, published, "no metadata for req_id {req_id!r} within")

    async def release(self, req_id: str) -> None:
        record = self.table.get(req_id)
        if record is None:
            # Freed already; its own registration may still be on its way out.
            handover = self._regions.pending.get(req_id)
            if handover is not None:
                # Its first deregistration attempt; a failed one is retried by the owner.
                with anyio.move_on_after(self.config.cleanup_timeout_s, shield=True):
                    await handover.attempted.wait()
            self._raise_if_held(req_id)
            return
        self.request_release(record)
        if record.phase is Phase.ENCODING:
            return
        # Sends in flight are bounded by their own timeouts.
        while not record.retired:
            await self.wakeups.park(record.req_id)
        await self.settle(record)
        self._raise_if_held(req_id)

    def _raise_if_held(self, req_id: str) -> None:
        """:raises TransferTimeoutError: the freed memory of ``req_id`` is still held: a
        transfer of it ended with an unknown outcome and may still land."""
        if self._regions.held.is_held(req_id):
            raise TransferTimeoutError(
                f"req_id {req_id!r} is released, but a transfer of its embedding ended with "
                "an unknown outcome: it may still land in its destination, and the embedding's "
                "memory is held until the engine reports that transfer ended",
                req_id=req_id,
            )

    async def abandon(self, req_id: str) -> None:
        record = self.table.abandon(req_id)
        if record is not None:
            await self.release(req_id)

    async def settle(self, record: RequestRecord) -> None:
        """Wait, shielded and at most ``cleanup_timeout_s``, until a releasing record was
        freed and a first attempt to deregister its own registration (if any) ended. Past
        that bound, or after a failed attempt, the work goes on where it belongs (the
        record's last job frees it; the region owner keeps the region, its memory counted
        as staged): nothing is reported failed."""
        if record.retired and record.handover is None:
            return
        with anyio.move_on_after(self.config.cleanup_timeout_s, shield=True):
            while not record.retired:
                await self.wakeups.park(record.req_id)
            if record.handover is not None:
                # Its first deregistration attempt; a failed one is retried by the owner.
                await record.handover.attempted.wait()
