"""``PendingEmbeddings``: the landing state of one request on the prefill side.

Made and owned by an ``async with receiver.expect(plan)`` block. Its ``note_*`` methods
record what encoders said and sent (checked by :mod:`._validate`); :meth:`target` hands
an encoder the place to send a part to, and for Mooncake tracks whether a write into its
landing pages may still be in flight, so that leaving the block frees them or holds them
(:mod:`._landing_holds`) until the encoder confirms the write ended.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from .._errors import BadRequestError, EncdisaggError, InternalError, RequestNotActiveError
from ._plan import part_req_id
from ._received import EmbeddingPart, ReceivedEmbeddings
from ._targets import MooncakeSendTarget, SendTarget, ZmqSendTarget
from ._validate import (
    check_agreement,
    check_header_ids,
    check_header_layout,
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
    from ._landing import PageRun
    from ._landing_holds import Recheck
    from ._messages import PartMetadata
    from ._plan import RequestPlan
    from ._receiver import EmbeddingReceiver

__all__ = ["PendingEmbeddings"]


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

    def __init__(self, receiver: EmbeddingReceiver, plan: RequestPlan) -> None:
        self._receiver = receiver
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
        receiver = self._receiver
        check_metadata_size(
            self.plan,
            metadata,
            where,
            hidden_size=receiver.hidden_size,
            dtype=receiver.dtype,
            itemsize=receiver.itemsize,
        )
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
        receiver = self._receiver
        check_header_payload(
            self.plan, header, where, hidden_size=receiver.hidden_size, dtype=receiver.dtype
        )
        check_header_layout(self.plan, header, where, layout=receiver.layout)
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
                    video_timing=metadata.video_timing,
                )
            )
        return ReceivedEmbeddings(rid=self.rid, parts=tuple(parts), layout=self._receiver.layout)

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
        receiver = self._receiver
        check_part_index(self.plan, part_idx, "target")
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

    def _close(self) -> None:
        """Drop the tensors; free the runs nobody writes into, hold the others."""
        self._closed = True
        self._tensors.clear()
        receiver = self._receiver
        for part_idx, run in self._runs.items():
            if self._writes.get(part_idx) is _Write.TARGETED:
                receiver._hold_run(
                    run, part_req_id(self.rid, part_idx), self._rechecks.get(part_idx)
                )
            else:
                receiver.pool.free(run)
        self._runs.clear()
        self._writes.clear()
        self._rechecks.clear()
        self._wake()
