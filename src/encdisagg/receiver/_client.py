"""``EncoderClient``: the prefill side's HTTP client of a set of encoder servers."""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import httpx

from .. import _tracing
from .._errors import BadRequestError, ConfigError, EncdisaggError, ServiceUnavailableError
from .._modality import Modality
from .._numbers import real
from ._call_errors import (
    TIMED_OUT,
    UNREACHABLE,
    EncoderCallError,
    ReleaseOutcome,
    first_error,
)
from ._encoder_wire import PartMetadata, SendTarget, needs_conversion, wire_items
from ._fleet import EncoderFleet
from ._plan import PartPlan, RequestPlan, assign_parts
from ._routing import FleetRouting

__all__ = ["TIMED_OUT", "UNREACHABLE", "EncoderCallError", "EncoderClient", "ReleaseOutcome"]

_log = logging.getLogger("encdisagg.receiver")


class _ReleaseAnswer(enum.Enum):
    CONFIRMED = "confirmed"
    HELD = "held"
    UNCONFIRMED = "unconfirmed"


def _is_encoder_error(response: httpx.Response) -> bool:
    """Whether ``response`` carries the encoder's own error body (``{"status": "error",
    "message": ...}``), rather than a gateway's or a proxy's."""
    try:
        body = response.json()
    except ValueError:
        return False
    return (
        isinstance(body, Mapping)
        and body.get("status") == "error"
        and isinstance(body.get("message"), str)
    )


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return text[:200] if text else response.reason_phrase
    if isinstance(body, Mapping) and isinstance(body.get("message"), str):
        return str(body["message"])
    return str(body)[:200]


class EncoderClient(anyio.AsyncContextManagerMixin):
    """Sends the media of requests to a set of encoder servers, over HTTP.

    ``async with EncoderClient(urls) as client:`` opens one connection pool for all encoders
    (``httpx``; runs on asyncio and on Trio); leaving the block closes it.

    A request's items are split into parts by modality and spread over the encoders
    (:meth:`plan`, see :func:`assign_parts`); :meth:`encode` posts every part's
    ``/encode`` at once, :meth:`send` asks an encoder to deliver one part,
    :meth:`release_outcome` lets go of parts and says which may still be written into. Every
    call is bounded; a failure names the encoder that failed (:class:`EncoderCallError`).

    :param urls: the encoders' base URLs (``http://host:port``).
    :param encode_timeout_s: bound on one ``/encode`` call.
    :param send_timeout_s: bound on one ``/send`` call.
    :param release_timeout_s: bound on the best-effort ``/release`` calls after a failure.
    :param connect_timeout_s: bound on opening a connection.
    :param max_connections: connections kept open in all.
    :param api_key: sent as ``Authorization: Bearer <api_key>`` on every call, for
        encoders served with ``--api-key``.
    :param transport: an ``httpx`` transport to use instead of the network (tests).
    :param registry: instead of ``urls``, an encoder fleet to discover through etcd
        (``etcd://HOST:PORT/PREFIX``, or an :class:`EncoderFleet`): requests are then
        planned over its live encoders (by affinity under a load bound, or least-loaded:
        see :class:`EncoderFleet`), and :func:`fetch_from_fleet` fails parts over between them.
    :param model: with ``registry``, only encoders of this model are used.
    :param routing: with ``registry`` given as a URL, how the fleet routes items (default:
        by affinity under a load bound); an :class:`EncoderFleet` you pass carries its own.
    """

    def __init__(
        self,
        urls: Sequence[str] = (),
        *,
        encode_timeout_s: float = 60.0,
        send_timeout_s: float = 60.0,
        release_timeout_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        max_connections: int = 64,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        registry: str | EncoderFleet | None = None,
        model: str | None = None,
        routing: FleetRouting | None = None,
    ) -> None:
        if routing is not None and not isinstance(registry, str):
            raise ConfigError(
                "routing goes with registry='etcd://...'; an EncoderFleet carries its own"
            )
        if isinstance(registry, str):
            registry = EncoderFleet(registry, model=model, routing=routing)
        #: The discovered fleet, when built with a registry; plans then come from it.
        self.fleet = registry
        if registry is not None and urls:
            raise ConfigError("pass urls or a registry, not both")
        if registry is None and (isinstance(urls, str) or not urls):
            raise ConfigError("urls must be a non-empty list of encoder URLs")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"urls: {url!r} is not an http(s) URL")
        for name, value in (
            ("encode_timeout_s", encode_timeout_s),
            ("send_timeout_s", send_timeout_s),
            ("release_timeout_s", release_timeout_s),
            ("connect_timeout_s", connect_timeout_s),
        ):
            real(name, value, above=0, finite=False, error=ConfigError)
        self._urls = tuple(url.rstrip("/") for url in urls)
        self._encode_timeout_s = encode_timeout_s
        self._send_timeout_s = send_timeout_s
        self._release_timeout_s = release_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        if api_key is not None and (not api_key.isascii() or not api_key.isprintable()):
            raise ConfigError("api_key must be visible ASCII")
        self._headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        # Where the next request's first part goes; moves on with every plan.
        self._next_start = 0

    @property
    def urls(self) -> tuple[str, ...]:
        """The encoders' URLs (with a registry: those routable now)."""
        return self._urls if self.fleet is None else self.fleet.urls

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[EncoderClient]:
        """Entering opens the pool (not a checkpoint); leaving closes it (shielded)."""
        if self._client is not None:
            raise RuntimeError("an EncoderClient is entered once at a time")
        timeout = httpx.Timeout(None, connect=self._connect_timeout_s)
        limits = httpx.Limits(
            max_connections=self._max_connections,
            max_keepalive_connections=self._max_connections,
        )
        client = httpx.AsyncClient(
            timeout=timeout, limits=limits, headers=self._headers, transport=self._transport
        )
        self._client = client
        try:
            if self.fleet is None:
                yield self
            else:
                async with self.fleet:
                    yield self
        finally:
            self._client = None
            with anyio.move_on_after(self._release_timeout_s, shield=True):
                await client.aclose()

    # -- planning: synchronous ---------------------------------------------------------------

    def plan(self, rid: str, items: Mapping[Modality | str, Sequence[object]]) -> RequestPlan:
        """Split request ``rid``'s items into parts over the encoders. Not a checkpoint.

        Successive plans start at successive encoders, so single-item requests spread too.

        :raises BadRequestError: naming the field (empty id, no items, unknown modality).
        :raises ServiceUnavailableError: with a registry, no live encoder for a modality.
        """
        if self.fleet is not None:
            return self.fleet.plan(rid, items)
        plan = assign_parts(rid, items, self._urls, start=self._next_start)
        self._next_start = (self._next_start + 1) % len(self._urls)
        return plan

    # -- calls -------------------------------------------------------------------------------

    async def encode_part(self, part: PartPlan) -> PartMetadata:
        """``POST /encode`` for one part; returns what the encoder staged.

        A checkpoint. Cancelling it abandons the HTTP call; the encoder may still finish the
        encode, so call :meth:`release` for the part afterwards.

        The items are what :class:`~encdisagg.Encoder` takes: bytes, local paths and PIL
        images travel as data URLs (converted in a worker thread).

        :raises BadRequestError: naming the item that cannot travel over HTTP.
        :raises EncoderCallError: the encoder refused, failed, timed out, could not be
            reached, or answered for another part.
        """
        items: list[object] = list(part.items)
        if needs_conversion(items):
            items = await anyio.to_thread.run_sync(wire_items, items)
        body = {
            "req_id": part.req_id,
            "mm_items": items,
            "modality": part.modality.value,
            "num_parts": part.num_parts,
            "part_idx": part.part_idx,
        }
        metadata = await self._metadata(part, "/encode", body, self._encode_timeout_s)
        if len(metadata.token_counts) != len(part.items):
            raise self._error(
                part,
                "/encode",
                UNREACHABLE,
                f"answered with {len(metadata.token_counts)} token counts for "
                f"{len(part.items)} items",
            )
        return metadata

    async def staged(self, part: PartPlan) -> PartMetadata:
        """``POST /scheduler_receive_meta_data``: what the part's encoder staged for it (the
        ``/encode`` answer again), for a receiver that did not make the encode call itself.

        A checkpoint; cancelling it abandons the HTTP call and changes nothing on the encoder.

        :raises EncoderCallError: the encoder has no such part (404), could not be reached,
            or answered for another part.
        """
        body = {"req_id": part.req_id, "part_idx": part.part_idx}
        route = "/scheduler_receive_meta_data"
        return await self._metadata(part, route, body, self._send_timeout_s)

    async def encode(self, plan: RequestPlan) -> tuple[PartMetadata, ...]:
        """``POST /encode`` for every part of ``plan`` at once.

        A checkpoint. As soon as one part fails, the others are cancelled; every part that
        was dispatched is then released (best effort, shielded, bounded by
        ``release_timeout_s``) and the first failure is raised. The same release happens if
        the caller is cancelled.

        :return: the parts' metadata, in ``part_idx`` order.
        :raises EncoderCallError: naming the encoder and part that failed first.
        """
        results: dict[int, PartMetadata] = {}
        dispatched: list[PartPlan] = []

        async def one(part: PartPlan) -> None:
            dispatched.append(part)
            results[part.part_idx] = await self.encode_part(part)

        failure: BaseException | None = None
        try:
            async with anyio.create_task_group() as group:
                for part in plan.parts:
                    group.start_soon(one, part)
        except BaseException as exc:
            await self.release(dispatched)
            failure = first_error(exc)
            if failure is exc:
                raise
        if failure is not None:
            # Raised outside the handler, so the group does not tag along as its context.
            raise failure
        return tuple(results[index] for index in range(plan.num_parts))

    async def send(
        self, part: PartPlan, target: SendTarget, *, receive_count: int | None = None
    ) -> None:
        """``POST /send``: ask the part's encoder to deliver it to ``target``.

        A checkpoint. Returns once the encoder reports the delivery done: for a Mooncake
        target, the bytes are in the target memory; for ZMQ, the message left the encoder.
        If it raises or is cancelled, the encoder may still be writing: release the part
        and only reuse the target memory once that release is confirmed.

        :raises EncoderCallError: the encoder refused or failed the delivery, timed out, or
            could not be reached.
        """
        body = target.body(part.req_id)
        if receive_count is not None:
            body["receive_count"] = receive_count
        await self._post(part, "/send", body, self._send_timeout_s)

    async def release(self, parts: Iterable[PartPlan]) -> frozenset[str]:
        """``POST /release`` for each part, concurrently; best effort.

        As :meth:`release_outcome`, which tells the parts whose transfer may still land
        apart from those whose encoder did not answer.

        :return: the part ids whose release the encoder confirmed.
        """
        return (await self.release_outcome(parts)).confirmed

    async def release_outcome(self, parts: Iterable[PartPlan]) -> ReleaseOutcome:
        """``POST /release`` for each part, concurrently; best effort.

        A checkpoint, but shielded: it completes (bounded by ``release_timeout_s``) even if
        the caller is cancelled, and the cancellation arrives afterwards. Failures are
        logged, not raised.

        :return: which parts the encoders confirmed (no transfer of them can land any more:
            memory they were written into is free to reuse), which they reported held (a
            transfer may still land), and which are unconfirmed.
        """
        parts = list(parts)
        answers: dict[str, _ReleaseAnswer] = {}
        if not parts:
            await anyio.lowlevel.checkpoint()
            return ReleaseOutcome()

        async def one(part: PartPlan) -> None:
            answers[part.req_id] = await self._release_one(part, logging.WARNING)

        with anyio.move_on_after(self._release_timeout_s, shield=True):
            async with anyio.create_task_group() as group:
                for part in parts:
                    group.start_soon(one, part)
        await anyio.lowlevel.checkpoint_if_cancelled()

        def having(answer: _ReleaseAnswer) -> frozenset[str]:
            return frozenset(req_id for req_id, said in answers.items() if said is answer)

        confirmed, held = having(_ReleaseAnswer.CONFIRMED), having(_ReleaseAnswer.HELD)
        # A part cut off by the bound has no answer at all: unconfirmed too.
        unconfirmed = frozenset(part.req_id for part in parts) - confirmed - held
        return ReleaseOutcome(confirmed=confirmed, held=held, unconfirmed=unconfirmed)

    async def release_confirmed(self, part: PartPlan) -> bool:
        """``POST /release`` for ``part`` once more: whether its encoder now confirms that
        no transfer of it can land any more.

        For asking again about a part whose release was held or unconfirmed. A checkpoint,
        bounded by ``release_timeout_s``; cancelling it abandons the call (nothing is
        confirmed then). An answer other than 2xx is logged at debug level only: the asker
        repeats itself. Never raises an :class:`EncdisaggError`.
        """
        return await self._release_one(part, logging.DEBUG) is _ReleaseAnswer.CONFIRMED

    async def _release_one(self, part: PartPlan, level: int) -> _ReleaseAnswer:
        route = "/release"
        try:
            response = await self._call(
                part, route, {"req_id": part.req_id}, self._release_timeout_s
            )
        except EncdisaggError as exc:
            _log.log(level, "releasing part %r on %s failed: %s", part.req_id, part.url, exc)
            return _ReleaseAnswer.UNCONFIRMED
        if response.is_success:
            return _ReleaseAnswer.CONFIRMED
        error = self._answer_error(part, route, response)
        if response.status_code == TIMED_OUT and _is_encoder_error(response):
            _log.log(
                level,
                "part %r on %s is released, but a transfer of it may still land: %s",
                part.req_id,
                part.url,
                error,
            )
            return _ReleaseAnswer.HELD
        _log.log(level, "releasing part %r on %s failed: %s", part.req_id, part.url, error)
        return _ReleaseAnswer.UNCONFIRMED

    # -- plumbing ----------------------------------------------------------------------------

    def _error(self, part: PartPlan, route: str, status: int, what: str) -> EncoderCallError:
        return EncoderCallError(
            f"encoder {part.url} {what} (POST {route} of part {part.part_idx} of request "
            f"{part.rid!r})",
            url=part.url,
            route=route,
            status=status,
            part_idx=part.part_idx,
            req_id=part.rid,
        )

    def _answer_error(
        self, part: PartPlan, route: str, response: httpx.Response
    ) -> EncoderCallError:
        status = response.status_code
        return self._error(part, route, status, f"answered {status}: {_error_message(response)}")

    async def _call(
        self, part: PartPlan, route: str, body: dict[str, Any], timeout_s: float
    ) -> httpx.Response:
        """POST ``body``; the response, whatever its status.

        :raises EncoderCallError: the encoder could not be reached (502) or did not answer
            within ``timeout_s`` (504).
        :raises ServiceUnavailableError: the client is not open.
        """
        client = self._client
        if client is None:
            raise ServiceUnavailableError("the EncoderClient is not open", req_id=part.rid)
        try:
            with anyio.fail_after(timeout_s):
                # The caller's trace (when traced) continues in the encoder's spans.
                headers = _tracing.outgoing_headers()
                return await client.post(part.url + route, json=body, headers=headers)
        except (TimeoutError, httpx.TimeoutException):
            raise self._error(
                part, route, TIMED_OUT, f"did not answer within {timeout_s} s"
            ) from None
        except httpx.HTTPError as exc:
            raise self._error(part, route, UNREACHABLE, f"could not be reached: {exc!r}") from None

    async def _metadata(
        self, part: PartPlan, route: str, body: dict[str, Any], timeout_s: float
    ) -> PartMetadata:
        """POST ``body``; the answer, the metadata of ``part``.

        :raises EncoderCallError: (502) the answer is not metadata, or another part's (the
            index is checked on ``/encode``, whose body named it).
        """
        response = await self._post(part, route, body, timeout_s)
        try:
            answer = response.json()
        except ValueError:
            raise self._error(
                part, route, UNREACHABLE, "answered with a body that is not JSON"
            ) from None
        try:
            metadata = PartMetadata.from_json(answer)
        except BadRequestError as exc:
            raise self._error(part, route, UNREACHABLE, f"answered badly: {exc}") from None
        if metadata.req_id != part.req_id or (
            route == "/encode" and metadata.part_idx != part.part_idx
        ):
            what = f"answered for {metadata.req_id!r} part {metadata.part_idx}"
            raise self._error(part, route, UNREACHABLE, what)
        return metadata

    async def _post(
        self, part: PartPlan, route: str, body: dict[str, Any], timeout_s: float
    ) -> httpx.Response:
        """POST ``body``; the response, refused unless its status is below 400 (all ``/send``
        needs: it answers ``null``)."""
        response = await self._call(part, route, body, timeout_s)
        if response.status_code >= 400:
            raise self._answer_error(part, route, response)
        return response
