"""SGLang 0.5.20's encoder protocol on top of our Encoder, transport-neutral.

The HTTP routes of ``encdisagg serve --wire sglang`` and the gRPC ``SglangEncoder`` service
both call :class:`SglangService` with the already-decoded fields SGLang's language side
sends, and answer what it returns (often ``None``) or the error it raises.

How each of SGLang's transfer modes maps onto the Encoder:

- ``zmq_to_tokenizer`` (``/encode`` names ``prefill_host`` and an ``embedding_port``) and the
  legacy scheduler mode (a list of ports): encode, then push ``[header, bytes]`` to each
  port before answering ``null``.
- ``zmq_to_scheduler`` (``embedding_port`` is ``null``): encode, wait for the ranks'
  ``/scheduler_receive_url`` registrations (before or after ``/encode``), push to each.
- ``mooncake`` (the server runs ``transfer="mooncake"``): ``/encode`` answers the sizes;
  each rank's ``/send`` is our Mooncake write, followed by the completion notice SGLang's
  receiver waits for on ``prefill_host:embedding_port``.

The header frame is SGLang's pickled ``EmbeddingData`` (written by
:mod:`encdisagg.transfer._sglang_frames`; nothing here unpickles anything). This service
writes it once per part and hands it to the Encoder (or the data-parallel worker holding the
part) in an :class:`SglangZmqDestination`; the Encoder pushes it with the raw bytes straight
from the staged memory, which its own scope frees once the push stopped touching it. A
failed part is pushed as an error part (``error_msg``/``error_code``) by this service, which
fails SGLang's waiting request, and the call raises the error too.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Final

import anyio

from ..._config import EncoderConfig
from ..._errors import (
    BadRequestError,
    EncdisaggError,
    InternalError,
    RequestNotActiveError,
    RequestTimeoutError,
    TransferError,
    TransferTimeoutError,
)
from ..._modality import Modality
from ...encoder import Encoder, EncodeResult, ZmqDestination
from ...encoder._types import SglangZmqDestination
from ...models._checkpoint import model_type_of
from ...nurseries import run_thread_to_completion
from ...transfer import ZmqPushPool
from ...transfer._sglang_frames import SglangPart, sglang_header
from ...transfer._wire import ForeignHeader
from .._access import PeerAllowList
from .._backend import Backend, LocalBackend, release_within
from .._client_watch import note_staged
from .._messages import MetadataBody, ReceiveUrlBody, SendBody, metadata_json
from ._bodies import SglangEncodeBody, SglangSendBody
from ._destinations import PushDestinations
from ._video import VideoFields, video_aux, video_fields

__all__ = ["SglangService"]

_log = logging.getLogger("encdisagg.server.sglang")

#: Mooncake parts remembered between their ``/encode`` and their last ``/send``.
_MAX_PARTS: Final = 65536
#: Bound on pushing an error part: a live receiver takes it at once; one that is gone
#: (it closed its socket on an earlier failure) should not hold the failing call long.
_ERROR_PUSH_TIMEOUT_S: Final = 5.0


@dataclass(eq=False)
class _MooncakePart:
    """What a Mooncake part's completion notice needs that ``/send`` does not carry."""

    num_parts: int
    modality: Modality
    created: float
    sent_to: set[str] = field(default_factory=set)


class SglangService(anyio.AsyncContextManagerMixin):
    """SGLang's encoder calls (``/encode``, ``/send``, ``/scheduler_receive_url``,
    ``/scheduler_receive_meta_data``) served by one running Encoder or backend.

    ``async with SglangService(encoder_or_backend) as sglang:`` opens the push pool its
    error parts and completion notices go through; leaving closes it. The Encoder (or
    backend) must be open while calls are made; this service never opens or closes it.

    :param source: a running :class:`~encdisagg.Encoder`, or a server backend.
    :param config: the Encoder's configuration (default: the Encoder's own). Its
        ``transfer`` picks the mode: ``"zmq"`` serves SGLang's two ZMQ modes,
        ``"mooncake"`` (or ``"loopback"``) its ``mooncake`` mode.
    :param peers: when given, the hosts a push or notice may go to (403 otherwise).
    """

    def __init__(
        self,
        source: Encoder | Backend,
        config: EncoderConfig | None = None,
        *,
        peers: PeerAllowList | None = None,
    ) -> None:
        if isinstance(source, Encoder):
            config = config or source.config
            source = LocalBackend(source)
        if config is None:
            raise TypeError("pass the EncoderConfig along with a backend")
        if config.zmq_curve_server_key is not None or config.zmq_curve_server_keys:
            # SGLang's receivers speak no CURVE: the Encoder's pushes to them go in the clear.
            raise BadRequestError("the sglang wire cannot be combined with ZMQ CURVE keys")
        self._backend = source
        self._config = config
        self._peers = peers
        # Error parts and completion notices: headers alone, no staged memory.
        self._pushes = ZmqPushPool(send_timeout_s=config.zmq_send_timeout_s)
        self._open = False
        self._destinations = PushDestinations(
            ttl_s=config.request_timeout_s + config.send_timeout_s
        )
        self._mooncake_parts: OrderedDict[str, _MooncakePart] = OrderedDict()
        #: ZMQ-mode parts whose ``/encode`` is in flight here.
        self._encoding: set[str] = set()
        #: Which of SGLang's video fields the model's parts fill (known once open).
        self._video_fields: VideoFields | None = None

    @property
    def mooncake(self) -> bool:
        """Whether this service serves SGLang's ``mooncake`` mode (also with the in-process
        ``loopback`` engine, which stands in for Mooncake)."""
        return self._config.transfer != "zmq"

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[SglangService]:
        model_type = await run_thread_to_completion(model_type_of, self._config.model)
        self._video_fields = video_fields(model_type)
        async with self._pushes:
            self._open = True
            try:
                yield self
            finally:
                self._open = False

    # -- the calls --------------------------------------------------------------------------

    async def encode(self, body: Mapping[str, object]) -> object:
        """SGLang's ``/encode``: encode one part, and deliver it as the mode says.

        A checkpoint. ZMQ modes: returns ``None`` once the part was pushed to every
        destination. Mooncake: returns the body without ``mm_items`` plus
        ``embedding_size``, ``embedding_len`` and ``embedding_dim``; the part stays staged
        for the ranks' ``/send``. A failed part is pushed as an error part first (ZMQ
        modes), then its error raised. Cancelled, the part is released (shielded).

        :raises BadRequestError: bad fields or media (SGLang: 400 / INVALID_ARGUMENT).
        :raises RequestNotActiveError: the part is live already (409); the live part is
            left as it was: no error part is pushed for the refused duplicate.
        :raises EncdisaggError: anything else (SGLang: its status / INTERNAL).
        """
        message = SglangEncodeBody.from_json(body)
        self._require_open()
        request = message.encode
        if message.push_urls is not None:
            for url in message.push_urls:
                self._check_peer("embedding_port", url, request.req_id)
        if self.mooncake:
            return await self._encode_mooncake(message, body)
        if request.req_id in self._encoding:
            # A duplicate of a part in flight: refused without an error part, which would
            # reach (and fail) the live part's receivers.
            raise RequestNotActiveError(
                f"req_id {request.req_id!r} is live already", req_id=request.req_id
            )
        self._encoding.add(request.req_id)
        try:
            await self._encode_zmq(message)
        finally:
            self._encoding.discard(request.req_id)
        return None

    async def _encode_zmq(self, message: SglangEncodeBody) -> None:
        request = message.encode
        unreachable: set[str] = set()
        try:
            result = await self._backend.encode(request)
        except EncdisaggError as exc:
            await self._fail_part(message, exc, unreachable)
            raise
        try:
            urls = message.push_urls
            if urls is None:
                urls = tuple(
                    await self._destinations.wait_complete(
                        request.req_id, self._config.request_timeout_s
                    )
                )
            await self._push_all(message, result, urls, unreachable)
        except EncdisaggError as exc:
            await self._fail_part(message, exc, unreachable)
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await release_within(
                    self._backend, request.req_id, self._config.cleanup_timeout_s, _log
                )
        if message.push_urls is None:
            self._destinations.finish(request.req_id)

    async def scheduler_receive_url(self, body: Mapping[str, object]) -> object:
        """SGLang's ``/scheduler_receive_url``: a scheduler rank's PULL endpoint for a part.

        Not waiting for the part: returns ``None`` at once (a checkpoint). The first
        registration fixes ``receive_count``. A part that failed already gets its error
        part pushed to the new destination before this returns.

        :raises BadRequestError: bad fields, a different ``receive_count``, or the part was
            pushed already ("Encoder request is not active").
        """
        message = ReceiveUrlBody.from_json(body)
        self._require_open()
        for index, url in enumerate(message.receive_urls):
            self._check_peer(f"receive_url[{index}]", url, message.req_id)
        new = self._destinations.register(
            message.req_id, message.receive_count, message.receive_urls
        )
        entry = self._destinations.get(message.req_id)
        if entry.failure is not None and new:
            await self._push_errors(message.req_id, new, *entry.failure)
        await anyio.lowlevel.checkpoint()
        return None

    async def scheduler_receive_meta_data(self, body: Mapping[str, object]) -> object:
        """SGLang's ``/scheduler_receive_meta_data`` (Mooncake): the part's sizes, once known.

        A checkpoint; waits at most ``request_timeout_s``. A failed part raises
        :class:`~encdisagg.InternalError` with the part's message (SGLang answers 500).

        :raises RequestTimeoutError: nothing was published in time (504).
        """
        message = MetadataBody.from_json(body)
        self._require_open()
        try:
            result = await self._backend.metadata(message)
        except RequestTimeoutError:
            raise
        except EncdisaggError as exc:
            raise InternalError(exc.message, req_id=message.req_id) from None
        return metadata_json(message.req_id, message.part_idx, result)

    async def send(self, body: Mapping[str, object]) -> object:
        """SGLang's ``/send`` (Mooncake): write the part into the rank's buffer, then push
        the completion notice to ``prefill_host:embedding_port``; returns ``None``.

        A checkpoint. Each rank sends its own ``/send``; the part is released once
        ``receive_count`` distinct ranks were served. Cancelled, returns only after the
        write stopped touching memory.

        :raises BadRequestError: bad fields, or this server does not run Mooncake.
        :raises InternalError: the part is unknown, released or failed, or the write or
            notice failed (SGLang answers 500, so its receiver fails fast).
        :raises TransferTimeoutError: the write's outcome is unknown: it may still land (504,
            as SGLang 0.5.23 answers a timed-out transfer).
        """
        message = SglangSendBody.from_json(body)
        self._require_open()
        req_id = message.send.req_id
        if not self.mooncake:
            raise BadRequestError(
                "/send needs an encoder serving transfer='mooncake' (the ZMQ modes push)",
                req_id=req_id,
            )
        self._check_peer("prefill_host", message.notice_url, req_id)
        info = self._mooncake_parts.get(req_id)
        if info is None:
            raise InternalError(f"req_id {req_id!r}: no staged embedding", req_id=req_id)
        try:
            result = await self._backend.metadata(MetadataBody(req_id, message.part_idx or 0))
            await self._backend.send(message.send)
        except BadRequestError:
            raise
        except TransferTimeoutError as exc:
            # Not a failure: the write may still land (SGLang 0.5.23 answers 504 too).
            self._mooncake_parts.pop(req_id, None)
            raise TransferTimeoutError(exc.message, req_id=req_id) from None
        except EncdisaggError as exc:
            # A failed write released the part: the other ranks' /send fail fast too.
            self._mooncake_parts.pop(req_id, None)
            raise InternalError(exc.message, req_id=req_id) from None
        destination = message.send.destination
        assert not isinstance(destination, ZmqDestination)
        info.sent_to.add(destination.endpoint)
        count = message.send.receive_count or self._config.default_receive_count
        if len(info.sent_to) >= count:
            self._mooncake_parts.pop(req_id, None)
        part = self._part(req_id, info.num_parts, message.part_idx, info.modality, result)
        try:
            await self._pushes.send(message.notice_url, _frame(part), None)
        except TransferError as exc:
            # The bytes landed, but this rank will not know: it fails at its own timeout.
            raise InternalError(exc.message, req_id=req_id) from None
        return None

    # -- the parts of the calls --------------------------------------------------------------

    def _require_open(self) -> None:
        if not self._open:
            raise TransferError("the SGLang service is not running")

    def _check_peer(self, name: str, url: str, req_id: str) -> None:
        if self._peers is not None:
            self._peers.check(name, url, req_id=req_id)

    async def _encode_mooncake(
        self, message: SglangEncodeBody, body: Mapping[str, object]
    ) -> object:
        request = message.encode
        req_id = request.req_id
        # A refused duplicate must leave the live part's entry as it was.
        previous = self._mooncake_parts.get(req_id)
        mine = self._remember(req_id, request.num_parts, message.modality)
        try:
            result = await self._backend.encode(request)
        except BaseException:
            if self._mooncake_parts.get(req_id) is mine:
                if previous is None:
                    del self._mooncake_parts[req_id]
                else:
                    self._mooncake_parts[req_id] = previous
            raise
        note_staged(req_id)  # released if the client leaves before the answer
        answer = {key: value for key, value in body.items() if key != "mm_items"}
        answer.update(
            embedding_size=result.nbytes,
            embedding_len=result.num_tokens,
            embedding_dim=result.hidden_size,
        )
        return answer

    def _remember(self, req_id: str, num_parts: int, modality: Modality) -> _MooncakePart:
        now = anyio.current_time()
        ttl = self._config.request_timeout_s + self._config.send_timeout_s
        parts = self._mooncake_parts
        while parts:
            oldest = next(iter(parts.values()))
            if now - oldest.created <= ttl and len(parts) < _MAX_PARTS:
                break
            parts.popitem(last=False)
        part = parts[req_id] = _MooncakePart(num_parts, modality, now)
        parts.move_to_end(req_id)
        return part

    async def _push_all(
        self,
        message: SglangEncodeBody,
        result: EncodeResult,
        urls: tuple[str, ...],
        unreachable: set[str],
    ) -> None:
        """The Encoder pushes the staged part to each of ``urls`` with one SGLang header, from
        its own memory; it releases the part once all were served (``receive_count``), or at
        the first failure. URLs whose push failed in transfer go into ``unreachable``.

        :raises EncdisaggError: the first failure (the others are logged beside it).
        """
        request = message.encode
        req_id = request.req_id
        header = sglang_header(
            self._part(req_id, request.num_parts, request.part_idx, message.modality, result)
        )
        failures: dict[str, EncdisaggError] = {}

        async def push(url: str) -> None:
            destination = SglangZmqDestination(url, header)
            try:
                await self._backend.send(SendBody(req_id, destination, len(urls)))
            except EncdisaggError as exc:
                failures[url] = exc

        async with anyio.create_task_group() as group:
            for url in urls:
                group.start_soon(push, url)
        if failures:
            unreachable.update(u for u, e in failures.items() if isinstance(e, TransferError))
            first, *others = failures.values()
            for other in others:
                _log.warning("%s", other)
            raise first

    async def _fail_part(
        self, message: SglangEncodeBody, exc: EncdisaggError, unreachable: set[str]
    ) -> None:
        """Push ``exc`` as an error part to every destination known but ``unreachable``
        (and, in scheduler mode, to those registering later). Errors pushing it are logged,
        never raised."""
        request = message.encode
        status = exc.status if 100 <= exc.status <= 599 else 500
        if message.push_urls is not None:
            urls = list(message.push_urls)
        else:
            urls = self._destinations.finish(request.req_id, (exc.message, status))
        urls = [url for url in urls if url not in unreachable]
        with anyio.CancelScope(shield=True):
            await self._push_errors(request.req_id, urls, exc.message, status, message)

    async def _push_errors(
        self,
        req_id: str,
        urls: list[str],
        error_msg: str,
        error_code: int,
        message: SglangEncodeBody | None = None,
    ) -> None:
        num_parts, part_idx, modality = 1, 0, Modality.IMAGE
        if message is not None:
            num_parts = message.encode.num_parts
            part_idx = message.encode.part_idx
            modality = message.modality
        header = _frame(
            SglangPart(
                req_id=req_id,
                num_parts=num_parts,
                part_idx=part_idx,
                modality=modality,
                send_time=time.time(),
                error_msg=error_msg,
                error_code=error_code,
            )
        )

        async def push(url: str) -> None:
            error: object = "nobody took it in time"
            with anyio.move_on_after(_ERROR_PUSH_TIMEOUT_S):
                try:
                    return await self._pushes.send(url, header, None)
                except TransferError as exc:
                    error = exc
            _log.warning("could not push the error part of %s to %s: %s", req_id, url, error)

        async with anyio.create_task_group() as group:
            for url in urls:
                group.start_soon(push, url)

    def _part(
        self,
        req_id: str,
        num_parts: int,
        part_idx: int | None,
        modality: Modality,
        result: EncodeResult,
    ) -> SglangPart:
        timestamps, seconds = video_aux(self._video_fields, result.video_timing)
        return SglangPart(
            req_id=req_id,
            num_parts=num_parts,
            part_idx=part_idx or 0,
            modality=modality,
            send_time=time.time(),
            grid=result.grid,
            shape=(result.num_tokens, result.hidden_size),
            dtype=result.dtype,
            video_timestamps=timestamps,
            second_per_grid_ts=seconds,
        )


def _frame(part: SglangPart) -> ForeignHeader:
    return ForeignHeader(part.req_id, part.part_idx, sglang_header(part))
