"""Fetching a request's embeddings: encode its media on the encoders and receive the result.

There is one fetch. :func:`fetch_embeddings` plans the request over the client's encoders
once and makes one attempt; :func:`fetch_from_fleet` plans it over a registry's live
encoders and fails parts over between them.

If an encoder of the fleet fails before its part's bytes arrived — it answers 503, the
connection is lost, or its lease runs out (it leaves the view) while its part is being
encoded or sent, or was sent but has not arrived (a ZMQ ``/send`` may return while the
message is still queued in the encoder's process, and a killed process takes it along) —
the attempt is cut short: every part dispatched is released (shielded, bounded; parts on an
encoder that is gone are left to their deadline there, and their landing pages, for
Mooncake, to the receiver's bound and policy: nobody can say when that encoder's write
ends), the encoder is left out, and the request is planned again over the others under
fresh part ids (``rid#~1#0``, ``rid#~1#1``...: :func:`~._plan.attempt_rid`), within the
request's one deadline. A late delivery of the abandoned attempt names an id nobody expects
any more and is dropped by the receiver (its landing pages, for Mooncake, stay held until
its write is confirmed stopped), so nothing arrives twice. The caller gets the embeddings
under its own ``rid``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Final

import anyio
import anyio.lowlevel

from .._errors import BadRequestError, RequestTimeoutError
from .._modality import Modality
from .._numbers import real, whole
from ._call_errors import (
    TIMED_OUT,
    UNREACHABLE,
    EncoderCallError,
    EncoderLeftError,
    first_error,
)
from ._client import EncoderClient
from ._fleet import EncoderFleet
from ._pending import PendingEmbeddings
from ._plan import PartPlan, RequestPlan
from ._received import ReceivedEmbeddings
from ._receiver import EmbeddingReceiver

__all__ = ["fetch_embeddings", "fetch_from_fleet", "release_dispatched"]

_log = logging.getLogger("encdisagg.receiver")

#: Answers that mean "this encoder cannot do it now; another may": worth a failover.
_FAILOVER_STATUSES: Final = frozenset({503, UNREACHABLE})

#: The plan of attempt ``n`` (0 first), without the encoders given.
Planner = Callable[[int, set[str]], RequestPlan]


@asynccontextmanager
async def fetch_embeddings(
    client: EncoderClient,
    receiver: EmbeddingReceiver,
    rid: str,
    items: Mapping[Modality | str, Sequence[object]],
    *,
    timeout_s: float = 120.0,
) -> AsyncIterator[ReceivedEmbeddings]:
    """Have the encoders embed ``items`` of request ``rid``, and yield the embeddings.

    Every part runs concurrently: ``POST /encode`` to its encoder, then a landing target
    from ``receiver`` (its ZMQ endpoint, or landing pages sized from the answer), then
    ``POST /send``. The block gets the request's embeddings once every part is in; they
    live until the block ends (copy what must outlive it).

    Entering is a checkpoint. If a part fails, an error part arrives, ``timeout_s`` passes
    or the caller is cancelled, the other parts are cancelled and every part that was
    dispatched is released on its encoder (shielded, bounded); landing pages whose write
    the release confirmed stopped are freed, the others held until their encoder confirms
    (see :func:`release_dispatched`).

    :raises EncoderCallError: an encoder failed a call (it names the encoder and part).
    :raises RequestTimeoutError: the parts did not all arrive within ``timeout_s``.
    :raises BadRequestError: an answer or header did not fit the request.
    """
    plan = client.plan(rid, items)
    async with _fetch(client, None, receiver, rid, lambda _n, _out: plan, timeout_s, 1) as got:
        yield got


@asynccontextmanager
async def fetch_from_fleet(
    client: EncoderClient,
    receiver: EmbeddingReceiver,
    rid: str,
    items: Mapping[Modality | str, Sequence[object]],
    *,
    timeout_s: float = 120.0,
    max_attempts: int = 4,
) -> AsyncIterator[ReceivedEmbeddings]:
    """Embed ``items`` of request ``rid`` on the fleet of ``client`` and yield them.

    ``client`` must have been built with a registry (``EncoderClient(registry=...)``).
    Entering is a checkpoint that returns once every part is in; the embeddings live until
    the block ends. Failures worth another encoder (see the module) are failed over, at
    most ``max_attempts`` plans in all, all within ``timeout_s``. Cancelling it releases
    what was dispatched, as :func:`fetch_embeddings` does.

    :raises EncoderCallError: a failure that another encoder would not cure (400...), or
        the last one once the attempts are used up.
    :raises ServiceUnavailableError: no live encoder is left for a modality.
    :raises BadRequestError: ``client`` has no registry, or the options are invalid.
    :raises RequestTimeoutError: the embeddings did not arrive within ``timeout_s``.
    """
    fleet = client.fleet
    if fleet is None:
        raise BadRequestError("fetch_from_fleet needs an EncoderClient(registry=...)")
    whole("max_attempts", max_attempts, least=1, error=BadRequestError)
    real("timeout_s", timeout_s, above=0, finite=False, error=BadRequestError)

    def plan(attempt: int, excluded: set[str]) -> RequestPlan:
        return fleet._plan_attempt(rid, attempt, items, excluded)

    async with _fetch(client, fleet, receiver, rid, plan, timeout_s, max_attempts) as got:
        yield got


@asynccontextmanager
async def _fetch(
    client: EncoderClient,
    fleet: EncoderFleet | None,
    receiver: EmbeddingReceiver,
    rid: str,
    plan: Planner,
    timeout_s: float,
    max_attempts: int,
) -> AsyncIterator[ReceivedEmbeddings]:
    """Attempts of one fetch, each planned without the encoders that failed before, all
    within ``timeout_s``; yields the embeddings under ``rid``, their landing state held
    until the block ends. Without a ``fleet`` (a static set of encoders) nobody watches
    departures or counts load."""
    excluded: set[str] = set()
    embeddings: ReceivedEmbeddings | None = None
    stack = AsyncExitStack()
    try:
        with anyio.fail_after(timeout_s):
            for attempt in range(max_attempts):
                stack = AsyncExitStack()
                pending = await stack.enter_async_context(receiver.expect(plan(attempt, excluded)))
                try:
                    embeddings = await _gather(client, fleet, pending)
                except BaseException as exc:
                    # Not a checkpoint: the landing state goes before anything else runs.
                    await stack.aclose()
                    url = _encoder_of(exc, _FAILOVER_STATUSES)
                    if url is None or attempt + 1 == max_attempts:
                        raise
                    _log.warning(
                        "request %r: encoder %s failed (%s); planning again without it",
                        rid,
                        url,
                        exc,
                    )
                    excluded.add(url)
                    continue
                break
    except TimeoutError:
        raise RequestTimeoutError(
            f"request {rid!r}: embeddings did not arrive within {timeout_s} s", req_id=rid
        ) from None
    assert embeddings is not None
    async with stack:
        yield dataclasses.replace(embeddings, rid=rid)


def _encoder_of(error: BaseException, statuses: Collection[int]) -> str | None:
    """The encoder ``error`` shows gone (it left), or failing a call with one of
    ``statuses``; else ``None``."""
    if isinstance(error, EncoderLeftError):
        return error.url
    if isinstance(error, EncoderCallError) and error.status in statuses:
        return error.url
    return None


async def _gather(
    client: EncoderClient, fleet: EncoderFleet | None, pending: PendingEmbeddings
) -> ReceivedEmbeddings:
    """One attempt: every part at once, cut short by a failure or a departure."""
    dispatched: list[PartPlan] = []

    async def one(part: PartPlan) -> None:
        dispatched.append(part)
        try:
            metadata = await client.encode_part(part)
            pending.note_metadata(metadata)
            target = await pending.target(part.part_idx)
            await client.send(part, target)
        except EncoderCallError as exc:
            if fleet is not None and exc.status in (*_FAILOVER_STATUSES, TIMED_OUT):
                fleet.mark_failed(part.url)
            raise
        finally:
            if fleet is not None:
                # No longer in flight on that encoder, as far as this client's routing counts.
                fleet.part_finished(part.url)
        pending.note_sent(part.part_idx)

    failure: BaseException | None = None
    try:
        async with anyio.create_task_group() as outer:
            if fleet is not None:
                outer.start_soon(_watch_departures, fleet, pending)
            async with anyio.create_task_group() as inner:
                for part in pending.plan.parts:
                    inner.start_soon(one, part)
                # Ends the attempt early with the request's own error (an error part...).
                inner.start_soon(pending.wait)
            outer.cancel_scope.cancel()
    except BaseException as exc:
        failure = first_error(exc)
        # With a fleet, parts on an encoder that is gone (unreachable) are left to their
        # deadline there; nobody can be asked about their landing pages, which follow the
        # receiver's bound.
        gone = None if fleet is None else _encoder_of(failure, (UNREACHABLE,))
        await release_dispatched(client, pending, [p for p in dispatched if p.url != gone])
        if failure is exc:
            raise
    if failure is not None:
        # Raised outside the handler, so the group does not tag along as its context.
        raise failure
    return pending.result()


async def _watch_departures(fleet: EncoderFleet, pending: PendingEmbeddings) -> None:
    """Raise :class:`EncoderLeftError` once an encoder holding a part whose bytes are not in
    left the view, even if its ``/send`` returned (the message may have died queued in the
    encoder's process). One that drained said so first and finishes what it holds: its
    calls run on. Never returns."""
    view = fleet.view
    while True:
        for part in pending.plan.parts:
            if (
                not pending.arrived(part.part_idx)
                and part.url not in view
                and part.url not in view.drained
            ):
                raise EncoderLeftError(part.url, pending.rid)
        await view.wait_changed()


async def release_dispatched(
    client: EncoderClient, pending: PendingEmbeddings, parts: Iterable[PartPlan]
) -> None:
    """Release ``parts`` of ``pending``'s request on their encoders, and say what that
    means for their landing pages.

    Parts confirmed stopped give their pages back with the request. The others (their
    encoder said the write may still land, or did not answer) keep them held, and the
    receiver asks their encoder again (:meth:`EncoderClient.release_confirmed`) until it
    confirms or the receiver's bound runs out.

    A checkpoint, shielded and bounded by the client's ``release_timeout_s``: the outcome
    is recorded before a cancellation of the caller arrives, once this returns.
    """
    parts = list(parts)
    with anyio.CancelScope(shield=True):
        outcome = await client.release_outcome(parts)
    pending.confirm_stopped(outcome.confirmed)
    for part in parts:
        if part.req_id not in outcome.confirmed:
            pending.hold_until_confirmed(part.part_idx, partial(client.release_confirmed, part))
    await anyio.lowlevel.checkpoint_if_cancelled()
