"""``EmbeddingReceiver``: where embeddings from encoders land on the prefill side.

Two ways in:

- ZMQ: one PULL socket per receiver (:class:`~encdisagg.transfer.ZmqReceiver`); a
  dispatcher task routes every message to the request it belongs to by its part id.
- Mooncake: a :class:`LandingPool` registered once with the receiver's engine; each part
  gets a run of pages the encoder writes into, and is there once its ``/send`` returned.

A request's landing state is a :class:`PendingEmbeddings`, owned by the ``async with
receiver.expect(plan)`` block that created it: leaving the block frees its pages (or
quarantines those an encoder may still write into) and drops its tensors, on every path.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import anyio
import anyio.abc
import anyio.lowlevel
import torch

from .._errors import (
    BadRequestError,
    EncdisaggError,
    InternalError,
    RequestNotActiveError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from .._modality import Modality
from ..transfer import EmbeddingHeader, ReceivedPart, ZmqReceiver, dtype_name
from ._client import MooncakeSendTarget, SendTarget, ZmqSendTarget
from ._landing import LandingPool, PageRun
from ._messages import PartMetadata
from ._plan import PART_SEPARATOR, RequestPlan, part_req_id

if TYPE_CHECKING:
    from ..transfer import TransferEngine

__all__ = [
    "EmbeddingPart",
    "EmbeddingReceiver",
    "ModalityEmbeddings",
    "PendingEmbeddings",
    "ReceivedEmbeddings",
    "ReceiverStats",
]

_log = logging.getLogger("encdisagg.receiver")

TRANSPORTS: Final = ("zmq", "mooncake")


@dataclass(frozen=True, slots=True)
class EmbeddingPart:
    """One received part: ``tensor`` is ``[tokens, hidden]``."""

    part_idx: int
    modality: Modality
    tensor: torch.Tensor
    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class ModalityEmbeddings:
    """Every item of one modality, in the request's item order."""

    modality: Modality
    #: ``[tokens, hidden]``: the items' tokens, one after the other.
    tensor: torch.Tensor
    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class ReceivedEmbeddings:
    """A request's embeddings, all parts in ``part_idx`` order.

    The tensors may be views of landing memory: valid only inside the ``expect`` block
    (or :func:`fetch_embeddings` block) that produced them. Copy what must outlive it.
    """

    rid: str
    parts: tuple[EmbeddingPart, ...]

    def of(self, modality: Modality | str) -> ModalityEmbeddings | None:
        """The parts of ``modality`` joined (a copy when there are several), or ``None``."""
        kind = Modality.parse(modality)
        chosen = [part for part in self.parts if part.modality is kind]
        if not chosen:
            return None
        tensor = chosen[0].tensor if len(chosen) == 1 else torch.cat([p.tensor for p in chosen])
        return ModalityEmbeddings(
            modality=kind,
            tensor=tensor,
            token_counts=tuple(n for part in chosen for n in part.token_counts),
            grid=tuple(g for part in chosen for g in part.grid),
        )


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """A snapshot of a receiver. ``live_requests``, ``landing_pages_in_use`` and
    ``quarantined_pages`` are zero when it is idle."""

    live_requests: int
    parts_received: int
    stale_parts_dropped: int
    malformed_messages: int
    landing_pages: int
    landing_pages_in_use: int
    quarantined_pages: int


class _Write(enum.Enum):
    """Where a Mooncake part's landing run stands: may an encoder still write into it?"""

    TARGETED = "targeted"  # given to an encoder: a write may be in flight
    LANDED = "landed"  # the encoder's /send returned: the write is over
    STOPPED = "stopped"  # the encoder confirmed no write is in flight (a release answered)


class PendingEmbeddings:
    """The landing state of one request; made by :meth:`EmbeddingReceiver.expect`.

    Its ``note_*`` methods are synchronous decisions; :meth:`target` and :meth:`wait` are
    the async calls around them.
    """

    def __init__(self, receiver: EmbeddingReceiver, plan: RequestPlan) -> None:
        self._receiver = receiver
        self.plan = plan
        self.rid = plan.rid
        self._metadata: dict[int, PartMetadata] = {}
        self._headers: dict[int, EmbeddingHeader] = {}
        self._tensors: dict[int, torch.Tensor] = {}
        self._runs: dict[int, PageRun] = {}
        self._writes: dict[int, _Write] = {}
        self._error: EncdisaggError | None = None
        self._closed = False
        self._changed = anyio.Event()

    # -- decisions: synchronous --------------------------------------------------------------

    @property
    def error(self) -> EncdisaggError | None:
        return self._error

    @property
    def complete(self) -> bool:
        """Whether every part's metadata and bytes are in."""
        n = self.plan.num_parts
        return len(self._metadata) == n and len(self._tensors) == n

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def fail(self, error: EncdisaggError) -> None:
        """Fail the whole request with ``error`` (the first failure wins)."""
        if self._error is None and not self._closed:
            self._error = error
            self._wake()

    def _check_part(self, part_idx: int, where: str) -> None:
        if not 0 <= part_idx < self.plan.num_parts:
            raise BadRequestError(
                f"{where}: part {part_idx} is outside the {self.plan.num_parts} parts of "
                f"request {self.rid!r}",
                req_id=self.rid,
            )

    def note_metadata(self, metadata: PartMetadata) -> None:
        """Record a part's ``/encode`` answer after checking it against the plan.

        :raises BadRequestError: naming the field: another part id, a hidden size or dtype
            this receiver does not take, a size that does not fit the shape, a disagreement
            with the part's ZMQ header, or a repeat.
        """
        where = f"/encode answer of {metadata.req_id!r}"
        self._check_part(metadata.part_idx, where)
        expected_id = part_req_id(self.rid, metadata.part_idx)
        if metadata.req_id != expected_id:
            raise BadRequestError(f"{where}: req_id must be {expected_id!r}", req_id=self.rid)
        if metadata.part_idx in self._metadata:
            raise BadRequestError(f"{where}: part {metadata.part_idx} answered twice")
        receiver = self._receiver
        if metadata.embedding_dim != receiver.hidden_size:
            raise BadRequestError(
                f"{where}: embedding_dim is {metadata.embedding_dim}, the receiver takes "
                f"{receiver.hidden_size}",
                req_id=self.rid,
            )
        expected = metadata.embedding_len * metadata.embedding_dim * receiver.itemsize
        if metadata.embedding_size != expected:
            raise BadRequestError(
                f"{where}: embedding_size is {metadata.embedding_size} bytes; "
                f"{metadata.embedding_len} x {metadata.embedding_dim} of "
                f"{dtype_name(receiver.dtype)} take {expected}",
                req_id=self.rid,
            )
        header = self._headers.get(metadata.part_idx)
        if header is not None:
            _agree(header, metadata)
        self._metadata[metadata.part_idx] = metadata
        self._wake()

    def note_zmq_part(self, received: ReceivedPart) -> None:
        """Accept a part pushed over ZMQ; an error part fails the request.

        :raises BadRequestError: naming the field for a header that does not fit the plan
            (part count, part index, modality, dtype, hidden size) or a repeat.
        """
        header = received.header
        where = f"embedding header of {header.req_id!r}"
        if header.num_parts != self.plan.num_parts:
            raise BadRequestError(
                f"{where}: num_parts is {header.num_parts}, request {self.rid!r} has "
                f"{self.plan.num_parts}",
                req_id=self.rid,
            )
        self._check_part(header.part_idx, where)
        if header.req_id != part_req_id(self.rid, header.part_idx):
            raise BadRequestError(f"{where}: req_id does not match part {header.part_idx}")
        if header.error is not None:
            status = header.status or 500
            self.fail(
                _status_error(
                    status,
                    f"encoder failed part {header.part_idx} of request {self.rid!r}: "
                    f"{header.error}",
                    self.rid,
                )
            )
            return
        planned = self.plan.parts[header.part_idx].modality
        if header.modality != planned.value:
            raise BadRequestError(
                f"{where}: modality is {header.modality!r}, part {header.part_idx} is "
                f"{planned.value!r}",
                req_id=self.rid,
            )
        receiver = self._receiver
        if header.dtype != dtype_name(receiver.dtype):
            raise BadRequestError(
                f"{where}: dtype is {header.dtype!r}, the receiver takes "
                f"{dtype_name(receiver.dtype)!r}",
                req_id=self.rid,
            )
        if header.shape[1] != receiver.hidden_size:
            raise BadRequestError(
                f"{where}: hidden size is {header.shape[1]}, the receiver takes "
                f"{receiver.hidden_size}",
                req_id=self.rid,
            )
        if header.part_idx in self._tensors:
            raise BadRequestError(f"{where}: part {header.part_idx} arrived twice")
        metadata = self._metadata.get(header.part_idx)
        if metadata is not None:
            _agree(header, metadata)
        assert received.tensor is not None
        self._headers[header.part_idx] = header
        self._tensors[header.part_idx] = received.tensor
        self._wake()

    def note_sent(self, part_idx: int) -> None:
        """The encoder's ``/send`` of ``part_idx`` returned: for Mooncake, its bytes are in."""
        if self._receiver.transport != "mooncake":
            return
        run = self._runs.get(part_idx)
        metadata = self._metadata.get(part_idx)
        if run is None or metadata is None:
            raise InternalError(f"part {part_idx} of {self.rid!r} was sent without a target")
        self._writes[part_idx] = _Write.LANDED
        raw = self._receiver.pool.view(run, metadata.embedding_size)
        shape = (metadata.embedding_len, metadata.embedding_dim)
        self._tensors[part_idx] = raw.view(self._receiver.dtype).view(shape)
        self._wake()

    def confirm_stopped(self, part_ids: Iterable[str]) -> None:
        """The encoders confirmed these parts have no write in flight (a release answered)."""
        confirmed = set(part_ids)
        for part_idx, state in self._writes.items():
            if state is _Write.TARGETED and part_req_id(self.rid, part_idx) in confirmed:
                self._writes[part_idx] = _Write.STOPPED

    def result(self) -> ReceivedEmbeddings:
        """The assembled embeddings.

        :raises the request's error: if it failed.
        :raises InternalError: if parts are missing.
        """
        if self._error is not None:
            raise self._error
        if not self.complete:
            raise InternalError(f"request {self.rid!r} is not complete")
        parts = []
        for part in self.plan.parts:
            metadata = self._metadata[part.part_idx]
            tensor = self._tensors[part.part_idx]
            if tuple(tensor.shape) != (metadata.embedding_len, metadata.embedding_dim):
                raise BadRequestError(
                    f"part {part.part_idx} of {self.rid!r} has shape {tuple(tensor.shape)}, its "
                    f"/encode answer said {metadata.embedding_len} x {metadata.embedding_dim}",
                    req_id=self.rid,
                )
            parts.append(
                EmbeddingPart(
                    part_idx=part.part_idx,
                    modality=part.modality,
                    tensor=tensor,
                    token_counts=metadata.token_counts,
                    grid=metadata.grid,
                )
            )
        return ReceivedEmbeddings(rid=self.rid, parts=tuple(parts))

    # -- async around them -------------------------------------------------------------------

    async def target(self, part_idx: int) -> SendTarget:
        """Where the encoder of ``part_idx`` should deliver it.

        A checkpoint. ZMQ: the receiver's endpoint. Mooncake: a run of landing pages sized
        from the part's metadata (note it first), waiting (at most the receiver's
        ``alloc_timeout_s``) for pages to free up; from here on the run counts as written
        into until :meth:`note_sent` or :meth:`confirm_stopped`.

        :raises BadRequestError: the part is larger than the whole landing pool.
        :raises ServiceUnavailableError: no pages freed up in time, or the receiver closed.
        """
        await anyio.lowlevel.checkpoint()
        receiver = self._receiver
        self._check_part(part_idx, "target")
        if receiver.transport == "zmq":
            return ZmqSendTarget(receiver.url)
        metadata = self._metadata.get(part_idx)
        if metadata is None:
            raise InternalError(f"part {part_idx} of {self.rid!r} has no metadata yet")
        if part_idx in self._runs:
            raise InternalError(f"part {part_idx} of {self.rid!r} has a target already")
        run = await receiver._alloc_run(self.rid, metadata.embedding_size)
        if self._closed:
            # The request ended while the run was found: give it straight back.
            receiver.pool.free(run)
            raise RequestNotActiveError(f"request {self.rid!r} ended", req_id=self.rid)
        self._runs[part_idx] = run
        self._writes[part_idx] = _Write.TARGETED
        return MooncakeSendTarget(
            session_id=receiver.session_id,
            buffer_address=receiver.pool.address(run),
            prefill_host=receiver.host,
            embedding_port=receiver.port,
        )

    async def wait(self) -> ReceivedEmbeddings:
        """Wait until every part is in (or the request failed); a checkpoint.

        Not bounded by itself: put it under the caller's deadline.
        """
        await anyio.lowlevel.checkpoint()
        while self._error is None and not self.complete:
            await self._changed.wait()
        return self.result()

    # -- ending ------------------------------------------------------------------------------

    def _close(self, now: float, quarantine_s: float) -> None:
        """Drop the tensors; free the runs nobody writes into, quarantine the others."""
        self._closed = True
        self._tensors.clear()
        pool = self._receiver._pool
        for part_idx, run in self._runs.items():
            assert pool is not None
            if self._writes.get(part_idx) is _Write.TARGETED:
                _log.warning(
                    "request %r: part %d's landing pages are quarantined for %s s: its encoder "
                    "did not confirm that its write stopped",
                    self.rid,
                    part_idx,
                    quarantine_s,
                )
                pool.quarantine(run, now + quarantine_s)
            else:
                pool.free(run)
        self._runs.clear()
        self._writes.clear()
        self._wake()


def _agree(header: EmbeddingHeader, metadata: PartMetadata) -> None:
    if (
        header.shape != (metadata.embedding_len, metadata.embedding_dim)
        or header.token_counts != metadata.token_counts
        or header.grid != metadata.grid
    ):
        raise BadRequestError(
            f"part {metadata.part_idx} ({metadata.req_id!r}): its ZMQ header (shape "
            f"{list(header.shape)}, token_counts {list(header.token_counts)}) disagrees with its "
            f"/encode answer ({metadata.embedding_len} x {metadata.embedding_dim}, "
            f"token_counts {list(metadata.token_counts)})",
            req_id=metadata.req_id,
        )


def _status_error(status: int, message: str, rid: str) -> EncdisaggError:
    for cls in (BadRequestError, RequestTimeoutError, ServiceUnavailableError):
        if cls.status == status:
            return cls(message, req_id=rid)
    return EncdisaggError(message, req_id=rid)


class EmbeddingReceiver(anyio.AsyncContextManagerMixin):
    """Receives the embedding parts of requests from encoders.

    ``async with EmbeddingReceiver(...) as receiver:`` binds the ZMQ socket and starts its
    dispatcher, or registers the landing pool with ``engine``. Leaving the block fails the
    requests still expected, waits (shielded, bounded by ``close_timeout_s``) for their
    blocks to end, and then unbinds or deregisters.

    :param transport: ``"zmq"`` or ``"mooncake"``.
    :param hidden_size: the width every embedding must have (the language model's).
    :param dtype: the dtype every embedding must have.
    :param engine: the transfer engine landing memory is registered with (Mooncake).
    :param bind: the ZMQ endpoint to bind (port 0 picks one).
    :param landing_pages: pages of the Mooncake landing pool.
    :param page_bytes: bytes per landing page.
    :param alloc_timeout_s: how long a part waits for landing pages at most.
    :param quarantine_s: how long pages an encoder may still write into are held back.
    :param max_payload_bytes: ZMQ payloads larger than this are refused.
    :param close_timeout_s: bound on the wait for live requests when closing.
    """

    def __init__(
        self,
        *,
        transport: str,
        hidden_size: int,
        dtype: torch.dtype,
        engine: TransferEngine | None = None,
        bind: str = "tcp://127.0.0.1:0",
        landing_pages: int = 256,
        page_bytes: int = 16 * 1024,
        alloc_timeout_s: float = 30.0,
        quarantine_s: float = 60.0,
        max_payload_bytes: int | None = None,
        close_timeout_s: float = 10.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise BadRequestError(
                f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}"
            )
        if transport == "mooncake" and engine is None:
            raise BadRequestError("transport 'mooncake' needs an engine to register landing memory")
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise BadRequestError(f"hidden_size must be a positive integer; got {hidden_size!r}")
        dtype_name(dtype)
        self.transport = transport
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self._engine = engine
        self._bind = bind
        self._landing_pages = landing_pages
        self._page_bytes = page_bytes
        self._alloc_timeout_s = alloc_timeout_s
        self._quarantine_s = quarantine_s
        self._max_payload_bytes = max_payload_bytes
        self._close_timeout_s = close_timeout_s
        self._zmq: ZmqReceiver | None = None
        self._pool: LandingPool | None = None
        self._session_id: str | None = None
        self._open = False
        self._pending: dict[str, PendingEmbeddings] = {}
        self._all_closed = anyio.Event()
        self._space = anyio.Event()
        self._parts_received = 0
        self._stale = 0
        self._malformed = 0

    # -- addresses ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The ZMQ endpoint encoders push to (``transport="zmq"``, once open)."""
        if self._zmq is None:
            raise ServiceUnavailableError(
                "the receiver has no ZMQ endpoint (not open, or Mooncake)"
            )
        return self._zmq.url

    @property
    def pool(self) -> LandingPool:
        """The Mooncake landing pool (``transport="mooncake"``, once open)."""
        if self._pool is None:
            raise ServiceUnavailableError("the receiver has no landing pool (not open, or ZMQ)")
        return self._pool

    @property
    def session_id(self) -> str:
        """The engine session encoders write to."""
        if self._session_id is None:
            raise ServiceUnavailableError("the receiver is not open")
        return self._session_id

    @property
    def host(self) -> str:
        return self.session_id.rpartition(":")[0] or self.session_id

    @property
    def port(self) -> int:
        tail = self.session_id.rpartition(":")[2]
        return int(tail) if tail.isdigit() else 0

    def _closing(self) -> bool:
        return not self._open

    @property
    def is_open(self) -> bool:
        """Whether new requests are accepted."""
        return self._open

    def stats(self) -> ReceiverStats:
        pool = self._pool
        return ReceiverStats(
            live_requests=len(self._pending),
            parts_received=self._parts_received,
            stale_parts_dropped=self._stale,
            malformed_messages=self._malformed,
            landing_pages=0 if pool is None else pool.num_pages,
            landing_pages_in_use=0
            if pool is None
            else pool.num_pages - pool.available() - pool.quarantined_pages,
            quarantined_pages=0 if pool is None else pool.quarantined_pages,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[EmbeddingReceiver]:
        if self._open or self._all_closed.is_set():
            raise RuntimeError("an EmbeddingReceiver is entered once")
        if self.transport == "zmq":
            async with (
                ZmqReceiver(self._bind, max_payload_bytes=self._max_payload_bytes) as zmq_rx,
                anyio.create_task_group() as group,
            ):
                self._zmq = zmq_rx
                self._session_id = zmq_rx.url
                group.start_soon(self._dispatch, zmq_rx)
                try:
                    async with self._serving():
                        yield self
                finally:
                    group.cancel_scope.cancel("receiver closing")
                    self._zmq = None
            return
        assert self._engine is not None
        pool = LandingPool(self._landing_pages, self._page_bytes)
        async with pool.registered(self._engine):
            self._pool = pool
            self._session_id = self._engine.session_id
            async with self._serving():
                yield self

    @asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        self._open = True
        try:
            yield
        finally:
            self._open = False
            for pending in list(self._pending.values()):
                pending.fail(
                    ServiceUnavailableError("the embedding receiver closed", req_id=pending.rid)
                )
            if self._pending:
                with anyio.move_on_after(self._close_timeout_s, shield=True):
                    await self._all_closed.wait()
                if self._pending:
                    _log.error(
                        "embedding receiver closing with %d requests still expected: %s",
                        len(self._pending),
                        ", ".join(sorted(self._pending)[:5]),
                    )
            self._all_closed.set()

    @asynccontextmanager
    async def expect(self, plan: RequestPlan) -> AsyncIterator[PendingEmbeddings]:
        """Expect the parts of ``plan``; the block owns their landing memory.

        Entering is a checkpoint. Leaving drops the request's tensors and gives back its
        landing pages, except those an encoder may still be writing into (a ``/send`` that
        did not return and whose release was not confirmed): those are quarantined for
        ``quarantine_s``. Not a checkpoint on the way out.

        :raises ServiceUnavailableError: the receiver is not open.
        :raises RequestNotActiveError: the request id is expected already.
        """
        await anyio.lowlevel.checkpoint()
        if not self.is_open:
            raise ServiceUnavailableError("the embedding receiver is not open", req_id=plan.rid)
        if plan.rid in self._pending:
            raise RequestNotActiveError(
                f"request {plan.rid!r} is expected already", req_id=plan.rid
            )
        pending = PendingEmbeddings(self, plan)
        self._pending[plan.rid] = pending
        try:
            yield pending
        finally:
            del self._pending[plan.rid]
            pending._close(anyio.current_time(), self._quarantine_s)
            self._space.set()
            self._space = anyio.Event()
            if not self._pending and self._closing():
                self._all_closed.set()

    # -- internals ---------------------------------------------------------------------------

    async def _alloc_run(self, rid: str, nbytes: int) -> PageRun:
        pool = self.pool
        count = pool.pages_for(nbytes)
        if count > pool.num_pages:
            raise BadRequestError(
                f"request {rid!r}: a {nbytes}-byte part does not fit the landing pool "
                f"({pool.num_pages} x {pool.page_bytes} bytes)",
                req_id=rid,
            )
        deadline = anyio.current_time() + self._alloc_timeout_s
        while True:
            if not self._open:
                raise ServiceUnavailableError("the embedding receiver closed", req_id=rid)
            now = anyio.current_time()
            run = pool.alloc(count, now=now)
            if run is not None:
                return run
            if now >= deadline:
                raise ServiceUnavailableError(
                    f"request {rid!r}: no {count} free landing pages within "
                    f"{self._alloc_timeout_s} s",
                    req_id=rid,
                )
            reclaim = pool.next_reclaim()
            wake = deadline if reclaim is None else min(deadline, reclaim)
            with anyio.move_on_after(max(0.0, wake - now)):
                await self._space.wait()

    async def _dispatch(self, rx: ZmqReceiver) -> None:
        while True:
            try:
                received = await rx.receive()
            except anyio.ClosedResourceError:
                return
            except BadRequestError as exc:
                self._malformed += 1
                _log.warning("dropping a malformed embedding message: %s", exc)
                pending = self._route(exc.req_id)
                if pending is not None:
                    pending.fail(exc)
                continue
            self._deliver(received)

    def _route(self, part_id: str | None) -> PendingEmbeddings | None:
        if not part_id:
            return None
        rid, separator, _ = part_id.rpartition(PART_SEPARATOR)
        return self._pending.get(rid) if separator else None

    def _deliver(self, received: ReceivedPart) -> None:
        pending = self._route(received.header.req_id)
        if pending is None:
            # A part of a request that ended (or never was): its memory goes with it.
            self._stale += 1
            _log.info("dropping a part of an unexpected request: %r", received.header.req_id)
            return
        self._parts_received += 1
        try:
            pending.note_zmq_part(received)
        except BadRequestError as exc:
            self._malformed += 1
            pending.fail(exc)
