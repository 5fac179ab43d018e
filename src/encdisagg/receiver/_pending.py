"""``PendingEmbeddings``: the landing state of one request on the prefill side.

Made and owned by an ``async with receiver.expect(plan)`` block. Its ``note_*`` methods
record what encoders said and sent (checked by :mod:`._validate` against the receiver's
:class:`EmbeddingSpec`); :meth:`target` hands an encoder the place to send a part to, in the
receiver's :class:`Landing`, and for Mooncake tracks whether a write into its landing pages
may still be in flight, so that leaving the block frees them or holds them
(:mod:`._landing_holds`) until the encoder confirms the write ended.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from .._errors import (
    BadRequestError,
    EncdisaggError,
    InternalError,
    RequestNotActiveError,
    ServiceUnavailableError,
)
from ._encoder_wire import MooncakeSendTarget, SendTarget, ZmqSendTarget, engine_address
from ._plan import part_req_id
from ._received import EmbeddingPart, ReceivedEmbeddings
from ._validate import (
    EmbeddingSpec,
    check_agreement,
    check_header_ids,
    check_header_payload,
    check_metadata_ids,
    check_metadata_size,
    check_metadata_timing,
    check_part_index,
    encoder_error,
)

if TYPE_CHECKING:
    import torch

    from ..transfer import EmbeddingHeader, ReceivedPart
    from ._encoder_wire import PartMetadata
    from ._landing import LandingPool, PageRun
    from ._landing_holds import HeldLandings, Recheck
    from ._plan import RequestPlan

__all__ = ["Landing", "PendingEmbeddings"]


@dataclass(slots=True, kw_only=True)
class Landing:
    """Where the parts of one open receiver land: what its requests' landing state needs of it.

    ZMQ: ``session_id`` is the endpoint encoders push to. Mooncake: it is the engine session
    that owns the registered ``pool``, of which a part takes a run of pages
    (:meth:`alloc_run`), and ``held`` keeps the runs an encoder may still write into.
    """

    session_id: str
    pool: LandingPool | None = None
    held: HeldLandings | None = None
    #: How long a part waits for landing pages at most.
    alloc_timeout_s: float = 30.0
    #: False once the receiver closes: no more pages are handed out.
    open: bool = True

    async def alloc_run(self, rid: str, nbytes: int) -> PageRun:
        """A run of ``nbytes`` for a part of ``rid``, waiting for pages to free up. A
        checkpoint when pages are short; cancelled while it waits, it takes no pages.

        :raises BadRequestError: the part is larger than the whole pool.
        :raises ServiceUnavailableError: no pages freed up in time, or the receiver closed.
        """
        pool = self.pool
        assert pool is not None
        count = pool.pages_for(nbytes)
        if count > pool.num_pages:
            raise BadRequestError(
                f"request {rid!r}: a {nbytes}-byte part does not fit the landing pool "
                f"({pool.num_pages} x {pool.page_bytes} bytes)",
                req_id=rid,
            )
        deadline = anyio.current_time() + self.alloc_timeout_s
        while True:
            if not self.open:
                raise ServiceUnavailableError("the embedding receiver closed", req_id=rid)
            run = pool.alloc(count)
            if run is not None:
                return run
            now = anyio.current_time()
            if now >= deadline:
                raise ServiceUnavailableError(
                    f"request {rid!r}: no {count} free landing pages within "
                    f"{self.alloc_timeout_s} s",
                    req_id=rid,
                )
            with anyio.move_on_after(deadline - now):
                await pool.wait_freed()


class _Write(enum.Enum):
    """Where a Mooncake part's landing run stands: may an encoder still write into it?"""

    TARGETED = "targeted"  # given to an encoder: a write may be in flight
    LANDED = "landed"  # the encoder's /send returned: the write is over
    STOPPED = "stopped"  # the encoder confirmed no write can land (a release answered 2xx)


class PendingEmbeddings:
    """The landing state of one request; made by :meth:`EmbeddingReceiver.expect`.

    Its ``note_*`` methods are synchronous decisions; :meth:`target` and :meth:`wait` are
    the async calls around them.
    """

    def __init__(self, plan: RequestPlan, landing: Landing, spec: EmbeddingSpec) -> None:
        self._landing = landing
        self._spec = spec
        self.plan = plan
        self.rid = plan.rid
        self._metadata: dict[int, PartMetadata] = {}
        self._headers: dict[int, EmbeddingHeader] = {}
        self._tensors: dict[int, torch.Tensor] = {}
        self._runs: dict[int, PageRun] = {}
        self._writes: dict[int, _Write] = {}
        # How to ask the encoder of a targeted part again whether its write ended.
        self._rechecks: dict[int, Recheck] = {}
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

    def arrived(self, part_idx: int) -> bool:
        """Whether the bytes of ``part_idx`` are in: pushed to this receiver, or written by
        a Mooncake ``/send`` that returned. Not a checkpoint."""
        return part_idx in self._tensors

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def fail(self, error: EncdisaggError) -> None:
        """Fail the whole request with ``error`` (the first failure wins)."""
        if self._error is None and not self._closed:
            self._error = error
            self._wake()

    def note_metadata(self, metadata: PartMetadata) -> None:
        """Record a part's ``/encode`` answer after checking it against the plan.

        :raises BadRequestError: naming the field: another part id, a hidden size or dtype
            this receiver does not take, a size that does not fit the shape, a disagreement
            with the part's ZMQ header, or a repeat.
        """
        where = f"/encode answer of {metadata.req_id!r}"
        check_metadata_ids(self.plan, metadata, where)
        if metadata.part_idx in self._metadata:
            raise BadRequestError(f"{where}: part {metadata.part_idx} answered twice")
        check_metadata_size(self.plan, metadata, where, self._spec)
        check_metadata_timing(self.plan, metadata, where)
        header = self._headers.get(metadata.part_idx)
        if header is not None:
            check_agreement(header, metadata)
        self._metadata[metadata.part_idx] = metadata
        self._wake()

    def note_zmq_part(self, received: ReceivedPart) -> None:
        """Accept a part pushed over ZMQ; an error part fails the request.

        :raises BadRequestError: naming the field for a header that does not fit the plan
            (part count, part index, modality, dtype, hidden size) or a repeat.
        """
        header = received.header
        where = f"embedding header of {header.req_id!r}"
        check_header_ids(self.plan, header, where)
        if header.error is not None:
            self.fail(encoder_error(self.plan, header))
            return
        check_header_payload(self.plan, header, where, self._spec)
        if header.part_idx in self._tensors:
            raise BadRequestError(f"{where}: part {header.part_idx} arrived twice")
        metadata = self._metadata.get(header.part_idx)
        if metadata is not None:
            check_agreement(header, metadata)
        assert received.tensor is not None
        self._headers[header.part_idx] = header
        self._tensors[header.part_idx] = received.tensor
        self._wake()

    def note_sent(self, part_idx: int) -> None:
        """The encoder's ``/send`` of ``part_idx`` returned: for Mooncake, its bytes are in."""
        pool = self._landing.pool
        if pool is None:
            return
        run = self._runs.get(part_idx)
        metadata = self._metadata.get(part_idx)
        if run is None or metadata is None:
            raise InternalError(f"part {part_idx} of {self.rid!r} was sent without a target")
        self._writes[part_idx] = _Write.LANDED
        raw = pool.view(run, metadata.embedding_size)
        shape = (metadata.embedding_len, metadata.embedding_dim)
        self._tensors[part_idx] = raw.view(self._spec.dtype).view(shape)
        self._wake()

    def confirm_stopped(self, part_ids: Iterable[str]) -> None:
        """The encoders confirmed that no write of these parts can land any more (their
        release answered 2xx): their landing pages are freed with the request. Not a
        checkpoint."""
        confirmed = set(part_ids)
        for part_idx, state in self._writes.items():
            if state is _Write.TARGETED and part_req_id(self.rid, part_idx) in confirmed:
                self._writes[part_idx] = _Write.STOPPED

    def hold_until_confirmed(self, part_idx: int, recheck: Recheck) -> None:
        """The encoder of ``part_idx`` did not confirm that its write stopped: it said the
        write may still land, or did not answer. Not a checkpoint.

        When the request ends, the part's landing pages stay held, and ``recheck`` is
        awaited (with backoff, by the receiver's own task) until it returns True, which
        frees them, or the receiver's ``quarantine_s`` ran out (then its
        ``on_quarantine_timeout`` decides). A part whose write is over (landed, or
        confirmed stopped) or that has no landing pages is not concerned.
        """
        check_part_index(self.plan, part_idx, "hold_until_confirmed")
        if self._writes.get(part_idx) is _Write.TARGETED:
            self._rechecks[part_idx] = recheck

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
            parts.append(
                EmbeddingPart(
                    part_idx=part.part_idx,
                    modality=part.modality,
                    tensor=self._tensors[part.part_idx],
                    token_counts=metadata.token_counts,
                    grid=metadata.grid,
                    video_timing=metadata.video_timing,
                )
            )
        return ReceivedEmbeddings(rid=self.rid, parts=tuple(parts), layout=self._spec.layout)

    # -- async around them -------------------------------------------------------------------

    async def target(self, part_idx: int) -> SendTarget:
        """Where the encoder of ``part_idx`` should deliver it.

        A checkpoint. ZMQ: the receiver's endpoint. Mooncake: a run of landing pages sized
        from the part's metadata (note it first), waiting (at most the receiver's
        ``alloc_timeout_s``) for pages to free up; from here on the run counts as written
        into until :meth:`note_sent` or :meth:`confirm_stopped`. Cancelled while it waits,
        it takes no pages.

        :raises BadRequestError: the part is larger than the whole landing pool.
        :raises ServiceUnavailableError: no pages freed up in time, or the receiver closed.
        """
        await anyio.lowlevel.checkpoint()
        landing = self._landing
        check_part_index(self.plan, part_idx, "target")
        if landing.pool is None:
            return ZmqSendTarget(landing.session_id)
        metadata = self._metadata.get(part_idx)
        if metadata is None:
            raise InternalError(f"part {part_idx} of {self.rid!r} has no metadata yet")
        if part_idx in self._runs:
            raise InternalError(f"part {part_idx} of {self.rid!r} has a target already")
        run = await landing.alloc_run(self.rid, metadata.embedding_size)
        if self._closed:
            # The request ended while the run was found: give it straight back.
            landing.pool.free(run)
            raise RequestNotActiveError(f"request {self.rid!r} ended", req_id=self.rid)
        self._runs[part_idx] = run
        self._writes[part_idx] = _Write.TARGETED
        address = landing.pool.address(run)
        return MooncakeSendTarget(landing.session_id, address, *engine_address(landing.session_id))

    async def wait(self) -> ReceivedEmbeddings:
        """Wait until every part is in (or the request failed); a checkpoint.

        Not bounded by itself: put it under the caller's deadline.
        """
        await anyio.lowlevel.checkpoint()
        while self._error is None and not self.complete:
            await self._changed.wait()
        return self.result()

    # -- ending ------------------------------------------------------------------------------

    def _close(self) -> None:
        """Drop the tensors; free the runs nobody writes into, hold the others."""
        self._closed = True
        self._tensors.clear()
        pool, held = self._landing.pool, self._landing.held
        for part_idx, run in self._runs.items():
            # Only Mooncake parts have runs.
            assert pool is not None
            assert held is not None
            if self._writes.get(part_idx) is _Write.TARGETED:
                held.hold(run, part_req_id(self.rid, part_idx), self._rechecks.get(part_idx))
            else:
                pool.free(run)
        self._runs.clear()
        self._writes.clear()
        self._rechecks.clear()
        self._wake()
