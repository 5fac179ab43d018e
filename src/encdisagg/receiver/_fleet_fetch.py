"""``fetch_from_fleet``: :func:`fetch_embeddings` over a registry's fleet, with failover.

A request is planned over the live encoders and fetched as :func:`fetch_embeddings` does.
If an encoder it uses fails before its part's bytes arrived — it answers 503, the
connection is lost, or its lease runs out (it leaves the view) while its part is being
encoded or sent, or was sent but has not arrived (a ZMQ ``/send`` may return while the
message is still queued in the encoder's process, and a killed process takes it along) —
the attempt is cut short: every part dispatched is released
(shielded, bounded; parts on an encoder that is gone are left to their deadline there, and
their landing pages, for Mooncake, to the receiver's bound and policy: nobody can say when
that encoder's write ends),
the encoder is left out, and the request is planned again over the others under fresh part
ids (``rid#~1#0``, ``rid#~1#1``...), within the request's one deadline. Attempt ids use the
part separator ``#``, which no caller's id may contain, so no attempt ever takes the id of
a request of the caller's own (``rid~1`` is a valid one). A late delivery of
the abandoned attempt names an id nobody expects any more and is dropped by the receiver
(its landing pages, for Mooncake, stay held until its write is confirmed stopped), so
nothing arrives twice. The caller gets the embeddings under its own ``rid``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Final

import anyio

from .._errors import BadRequestError, RequestTimeoutError, ServiceUnavailableError
from .._modality import Modality
from ._client import TIMED_OUT, UNREACHABLE, EncoderCallError, EncoderClient
from ._fetch import release_dispatched
from ._fleet import EncoderFleet
from ._groups import first_error
from ._pending import PendingEmbeddings
from ._plan import PartPlan, RequestPlan
from ._received import ReceivedEmbeddings
from ._receiver import EmbeddingReceiver

__all__ = ["fetch_from_fleet"]

_log = logging.getLogger("encdisagg.receiver")

#: Answers that mean "this encoder cannot do it now; another may": worth a failover.
_FAILOVER_STATUSES: Final = frozenset({503, UNREACHABLE})


class EncoderLeftError(ServiceUnavailableError):
    """An encoder left the registry (its lease ran out, or it drained) while it held an
    undelivered part of the request (503)."""

    def __init__(self, url: str, rid: str) -> None:
        super().__init__(f"encoder {url} left the registry during request {rid!r}", req_id=rid)
        self.url = url


def _gone_url(error: BaseException) -> str | None:
    """The encoder ``error`` shows to be unreachable (no release is sent there)."""
    if isinstance(error, EncoderLeftError):
        return error.url
    if isinstance(error, EncoderCallError) and error.status == UNREACHABLE:
        return error.url
    return None


def _failed_over_url(error: BaseException) -> str | None:
    """The encoder to leave out if ``error`` is worth another attempt, else ``None``."""
    if isinstance(error, EncoderLeftError):
        return error.url
    if isinstance(error, EncoderCallError) and error.status in _FAILOVER_STATUSES:
        return error.url
    return None


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
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise BadRequestError(f"max_attempts must be an integer >= 1; got {max_attempts!r}")
    if not timeout_s > 0:
        raise BadRequestError(f"timeout_s must be a positive number; got {timeout_s!r}")
    excluded: set[str] = set()
    embeddings: ReceivedEmbeddings | None = None
    attempt_stack = AsyncExitStack()
    try:
        with anyio.fail_after(timeout_s):
            for attempt in range(max_attempts):
                plan = fleet._plan_attempt(rid, attempt, items, excluded)
                attempt_stack = AsyncExitStack()
                pending = await attempt_stack.enter_async_context(receiver.expect(plan))
                try:
                    embeddings = await _gather(client, fleet, pending, excluded)
                except BaseException as exc:
                    # Not a checkpoint: the landing state goes before anything else runs.
                    await attempt_stack.aclose()
                    url = _failed_over_url(exc)
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
    async with attempt_stack:
        yield dataclasses.replace(embeddings, rid=rid)


async def _gather(
    client: EncoderClient,
    fleet: EncoderFleet,
    pending: PendingEmbeddings,
    excluded: set[str],
) -> ReceivedEmbeddings:
    """One attempt: every part at once, cut short by a failure or a departure."""
    dispatched: list[PartPlan] = []
    plan: RequestPlan = pending.plan

    async def one(part: PartPlan) -> None:
        dispatched.append(part)
        try:
            metadata = await client.encode_part(part)
            pending.note_metadata(metadata)
            target = await pending.target(part.part_idx)
            await client.send(part, target)
        except EncoderCallError as exc:
            if exc.status in _FAILOVER_STATUSES or exc.status == TIMED_OUT:
                fleet.mark_failed(part.url)
            raise
        finally:
            # No longer in flight on that encoder, as far as this client's routing counts.
            fleet.part_finished(part.url)
        pending.note_sent(part.part_idx)

    async def watch_departures() -> None:
        # A lease that ran out removes its encoder from the view: stop waiting on a part of
        # it whose bytes are not in, even if its /send returned (the message may have died
        # queued in the encoder's process). One that drained said so first and finishes
        # what it holds: its calls run on.
        view = fleet.view
        while True:
            for part in plan.parts:
                if (
                    not pending.arrived(part.part_idx)
                    and part.url not in view
                    and part.url not in view.drained
                ):
                    raise EncoderLeftError(part.url, pending.rid)
            await view.wait_changed()

    async def wait() -> None:
        # Ends the attempt early with the request's own error (an error part, a bad header).
        await pending.wait()

    failure: BaseException | None = None
    try:
        async with anyio.create_task_group() as outer:
            outer.start_soon(watch_departures)
            async with anyio.create_task_group() as inner:
                for part in plan.parts:
                    inner.start_soon(one, part)
                inner.start_soon(wait)
            outer.cancel_scope.cancel()
    except BaseException as exc:
        failure = first_error(exc)
        # Parts on an encoder that is gone are left to their deadline there; nobody can be
        # asked about their landing pages, which follow the receiver's bound and policy.
        gone = _gone_url(failure)
        reachable = [p for p in dispatched if p.url != gone]
        await release_dispatched(client, pending, reachable)
        if failure is exc:
            raise
    if failure is not None:
        raise failure
    return pending.result()
