"""``fetch_embeddings``: encode a request's media on the encoders and receive the result."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial

import anyio
import anyio.lowlevel

from .._errors import RequestTimeoutError
from .._modality import Modality
from ._client import EncoderClient
from ._groups import first_error
from ._pending import PendingEmbeddings
from ._plan import PartPlan
from ._received import ReceivedEmbeddings
from ._receiver import EmbeddingReceiver

__all__ = ["fetch_embeddings", "release_dispatched"]


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
    async with receiver.expect(plan) as pending:
        embeddings = await _gather(client, pending, timeout_s)
        yield embeddings


async def _gather(
    client: EncoderClient, pending: PendingEmbeddings, timeout_s: float
) -> ReceivedEmbeddings:
    dispatched: list[PartPlan] = []

    async def one(part: PartPlan) -> None:
        dispatched.append(part)
        metadata = await client.encode_part(part)
        pending.note_metadata(metadata)
        target = await pending.target(part.part_idx)
        await client.send(part, target)
        pending.note_sent(part.part_idx)

    async def wait() -> None:
        # Ends the group early with the request's own error (an error part, a bad header).
        await pending.wait()

    failure: BaseException | None = None
    try:
        with anyio.fail_after(timeout_s):
            async with anyio.create_task_group() as group:
                for part in pending.plan.parts:
                    group.start_soon(one, part)
                group.start_soon(wait)
    except BaseException as exc:
        await release_dispatched(client, pending, dispatched)
        failure = first_error(exc)
        if isinstance(failure, TimeoutError):
            failure = RequestTimeoutError(
                f"request {pending.rid!r}: embeddings did not arrive within {timeout_s} s",
                req_id=pending.rid,
            )
        elif failure is exc:
            raise
    if failure is not None:
        raise failure
    return pending.result()


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
