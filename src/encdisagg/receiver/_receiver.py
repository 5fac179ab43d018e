"""``EmbeddingReceiver``: where embeddings from encoders land on the prefill side.

Two ways in:

- ZMQ: one PULL socket per receiver (:class:`~encdisagg.transfer.ZmqReceiver`); a
  dispatcher task routes every message to the request it belongs to by its part id.
- Mooncake: a :class:`LandingPool` registered once with the receiver's engine; each part
  gets a run of pages the encoder writes into, and is there once its ``/send`` returned.

A request's landing state is a :class:`PendingEmbeddings`, owned by the ``async with
receiver.expect(plan)`` block that created it: leaving the block frees its pages and drops
its tensors, on every path. Pages an encoder may still write into are held instead, and
asked about again until their encoder confirms the write ended (:class:`HeldLandings`).
What the request's landing state needs of the receiver is its :class:`Landing` (the endpoint,
or the pool and its session) and its :class:`EmbeddingSpec`, not the receiver itself.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Final

import anyio
import anyio.abc
import anyio.lowlevel
import torch

from .. import _tracing
from .._errors import BadRequestError, RequestNotActiveError, ServiceUnavailableError
from .._numbers import real, whole
from ..transfer import EmbeddingLayout, HoldPolicy, ReceivedPart, ZmqReceiver
from ._encoder_wire import engine_address
from ._landing import LandingPool
from ._landing_holds import HeldLandings
from ._pending import Landing, PendingEmbeddings
from ._plan import RequestPlan, split_part_id
from ._received import ReceiverStats
from ._validate import EmbeddingSpec

if TYPE_CHECKING:
    from ..transfer import TransferEngine

__all__ = ["EmbeddingReceiver"]

_log = logging.getLogger("encdisagg.receiver")

TRANSPORTS: Final = ("zmq", "mooncake")
#: The span of a pushed part landing, under the encoder's transfer span.
RECEIVE_SPAN: Final = "encdisagg.receive"
#: The most tokens one part may carry by default: what Qwen2-VL's processor makes of one
#: image at its default ``max_pixels`` (12,845,056 pixels / 28² per merged token).
DEFAULT_MAX_PART_TOKENS: Final = 16384


class EmbeddingReceiver(anyio.AsyncContextManagerMixin):
    """Receives the embedding parts of requests from encoders.

    ``async with EmbeddingReceiver(...) as receiver:`` binds the ZMQ socket and starts its
    dispatcher, or registers the landing pool with ``engine`` and starts watching held
    pages. Leaving the block fails the requests still expected and waits (shielded, bounded
    by ``close_timeout_s``) for their blocks to end; then unbinds, or waits (likewise
    bounded) for the encoders still being asked about held pages and deregisters the pool.
    A pool with pages still held is neither deregistered nor freed: it is left to
    ``engine``, which keeps it until it closes.

    :param transport: ``"zmq"`` or ``"mooncake"``.
    :param hidden_size: the width every embedding must have (the language model's).
    :param dtype: the dtype every embedding must have.
    :param engine: the transfer engine landing memory is registered with (Mooncake).
    :param bind: the ZMQ endpoint to bind (port 0 picks one).
    :param landing_pages: pages of the Mooncake landing pool.
    :param page_bytes: bytes per landing page.
    :param alloc_timeout_s: how long a part waits for landing pages at most.
    :param quarantine_s: how long the receiver asks the encoder of a part whose write may
        still land (its release was held or unconfirmed) whether the write ended; its pages
        are held meanwhile, and freed when the encoder confirms.
    :param on_quarantine_timeout: what becomes of such pages when ``quarantine_s`` ran out
        without confirmation (a :class:`~encdisagg.transfer.HoldPolicy` or its value):
        ``"retire"`` (the default) keeps them out of use for good, so a late write never
        lands in another request; ``"reuse"`` hands them out again (logged as a warning),
        and a late write then lands in whichever request got them.
    :param max_part_tokens: the most tokens one part may have; a ZMQ payload larger than
        that many rows of ``hidden_size`` x ``dtype`` is refused before ZMQ buffers it.
    :param max_payload_bytes: the ZMQ payload bound in bytes, instead of the one
        ``max_part_tokens`` gives.
    :param close_timeout_s: bound on the wait for live requests when closing.
    :param curve_secret_key: the receiver's CURVE secret key (Z85; ZMQ only): pushes are
        then accepted only from encoders configured with its public key
        (:attr:`curve_public_key`), encrypted and authenticated.
    :param layout: the column sections every embedding has (e.g. Qwen3-VL's main embedding
        and deepstack maps); its width must be ``hidden_size``. A ZMQ header that names a
        layout must name this one; the received embeddings hand out each section as a view.
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
        on_quarantine_timeout: HoldPolicy | str = HoldPolicy.RETIRE,
        max_part_tokens: int = DEFAULT_MAX_PART_TOKENS,
        max_payload_bytes: int | None = None,
        close_timeout_s: float = 10.0,
        curve_secret_key: str | bytes | None = None,
        layout: EmbeddingLayout | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise BadRequestError(
                f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}"
            )
        if transport == "mooncake" and engine is None:
            raise BadRequestError("transport 'mooncake' needs an engine to register landing memory")
        self._spec = EmbeddingSpec(hidden_size, dtype, layout)
        whole("max_part_tokens", max_part_tokens, least=1, error=BadRequestError)
        real("quarantine_s", quarantine_s, least=0, finite=False, error=BadRequestError)
        try:
            #: What becomes of held pages once ``quarantine_s`` ran out without confirmation.
            self.on_quarantine_timeout = HoldPolicy.parse(
                on_quarantine_timeout, field="on_quarantine_timeout"
            )
        except ValueError as exc:
            raise BadRequestError(str(exc)) from None
        self.transport = transport
        self.hidden_size, self.dtype, self.layout = hidden_size, dtype, layout
        self.itemsize = dtype.itemsize
        self._engine = engine
        self._bind = bind
        self._landing_pages = landing_pages
        self._page_bytes = page_bytes
        self._alloc_timeout_s = alloc_timeout_s
        self._quarantine_s = quarantine_s
        self.max_part_tokens = max_part_tokens
        self._max_payload_bytes = (
            max_part_tokens * hidden_size * self.itemsize
            if max_payload_bytes is None
            else max_payload_bytes
        )
        self._close_timeout_s = close_timeout_s
        self._curve_secret_key = curve_secret_key
        self._zmq: ZmqReceiver | None = None
        # Set once open, kept once closed (its pool's figures stay readable).
        self._landing: Landing | None = None
        self._pending: dict[str, PendingEmbeddings] = {}
        self._all_closed = anyio.Event()
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
    def curve_public_key(self) -> bytes | None:
        """The CURVE key encoders must push with (Z85), once open; ``None`` without CURVE."""
        return None if self._zmq is None else self._zmq.curve_public_key

    @property
    def pool(self) -> LandingPool:
        """The Mooncake landing pool (``transport="mooncake"``, once open)."""
        pool = None if self._landing is None else self._landing.pool
        if pool is None:
            raise ServiceUnavailableError("the receiver has no landing pool (not open, or ZMQ)")
        return pool

    @property
    def session_id(self) -> str:
        """The engine session encoders write to."""
        if self._landing is None:
            raise ServiceUnavailableError("the receiver is not open")
        return self._landing.session_id

    @property
    def host(self) -> str:
        return engine_address(self.session_id)[0]

    @property
    def port(self) -> int:
        return engine_address(self.session_id)[1]

    @property
    def is_open(self) -> bool:
        """Whether new requests are accepted."""
        return self._landing is not None and self._landing.open

    def stats(self) -> ReceiverStats:
        pool = None if self._landing is None else self._landing.pool
        if pool is None:
            in_use = quarantined = retired = held_bytes = 0
        else:
            quarantined, retired = pool.quarantined_pages, pool.retired_pages
            in_use = pool.num_pages - pool.available() - quarantined - retired
            held_bytes = pool.held_bytes
        return ReceiverStats(
            live_requests=len(self._pending),
            parts_received=self._parts_received,
            stale_parts_dropped=self._stale,
            malformed_messages=self._malformed,
            landing_pages=0 if pool is None else pool.num_pages,
            landing_pages_in_use=in_use,
            quarantined_pages=quarantined,
            retired_pages=retired,
            held_pages=quarantined + retired,
            held_bytes=held_bytes,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[EmbeddingReceiver]:
        if self._landing is not None:
            raise RuntimeError("an EmbeddingReceiver is entered once")
        if self.transport == "zmq":
            async with (
                ZmqReceiver(
                    self._bind,
                    max_payload_bytes=self._max_payload_bytes,
                    curve_secret_key=self._curve_secret_key,
                ) as zmq_rx,
                anyio.create_task_group() as group,
            ):
                self._zmq = zmq_rx
                group.start_soon(self._dispatch, zmq_rx)
                try:
                    async with self._serving(Landing(session_id=zmq_rx.url)):
                        yield self
                finally:
                    group.cancel_scope.cancel("receiver closing")
                    self._zmq = None
            return
        assert self._engine is not None
        pool = LandingPool(self._landing_pages, self._page_bytes)
        held = HeldLandings(
            pool,
            bound_s=self._quarantine_s,
            policy=self.on_quarantine_timeout,
            close_timeout_s=self._close_timeout_s,
        )
        # Left in reverse: the requests end; the encoders still asked about held pages get
        # until close_timeout_s to confirm; then the pool is deregistered, or left to the
        # engine if pages are still held.
        async with pool.registered(self._engine, close_timeout_s=self._close_timeout_s), held:
            landing = Landing(
                session_id=self._engine.session_id,
                pool=pool,
                held=held,
                alloc_timeout_s=self._alloc_timeout_s,
            )
            async with self._serving(landing):
                yield self

    @asynccontextmanager
    async def _serving(self, landing: Landing) -> AsyncIterator[None]:
        self._landing = landing
        try:
            yield
        finally:
            landing.open = False
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
        did not return and whose release was not confirmed): those stay held until their
        encoder confirms the write ended (see :meth:`PendingEmbeddings.hold_until_confirmed`)
        or ``quarantine_s`` ran out. Not a checkpoint on the way out.

        :raises ServiceUnavailableError: the receiver is not open.
        :raises RequestNotActiveError: the request id is expected already.
        """
        await anyio.lowlevel.checkpoint()
        landing = self._landing
        if landing is None or not landing.open:
            raise ServiceUnavailableError("the embedding receiver is not open", req_id=plan.rid)
        if plan.rid in self._pending:
            raise RequestNotActiveError(
                f"request {plan.rid!r} is expected already", req_id=plan.rid
            )
        pending = PendingEmbeddings(plan, landing, self._spec)
        self._pending[plan.rid] = pending
        try:
            yield pending
        finally:
            del self._pending[plan.rid]
            pending._close()
            if not self._pending and not self.is_open:
                self._all_closed.set()

    # -- internals ---------------------------------------------------------------------------

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
        # No request has an empty id: an id without a request's part routes nowhere.
        return self._pending.get(split_part_id(part_id or "")[0])

    def _deliver(self, received: ReceivedPart) -> None:
        pending = self._route(received.header.req_id)
        if pending is None:
            # A part of a request that ended (or never was): its memory goes with it.
            self._stale += 1
            _log.info("dropping a part of an unexpected request: %r", received.header.req_id)
            return
        self._parts_received += 1
        try:
            with _receive_span(received):
                pending.note_zmq_part(received)
        except BadRequestError as exc:
            self._malformed += 1
            pending.fail(exc)


def _receive_span(received: ReceivedPart) -> AbstractContextManager[object]:
    """A span under the encoder's push (the header's ``traceparent``) while the part lands;
    a no-op for a part pushed untraced, or when nobody traces here."""
    header = received.header
    if header.traceparent is None:
        return _tracing.span(None, RECEIVE_SPAN)
    attributes = {"encdisagg.req_id": header.req_id, "encdisagg.part_idx": header.part_idx}
    return _tracing.span(_tracing.from_traceparent(header.traceparent), RECEIVE_SPAN, attributes)
