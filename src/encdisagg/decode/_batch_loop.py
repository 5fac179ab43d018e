"""The decode scheduler's async shell: one batched step around the synchronous core."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import anyio
import anyio.lowlevel

from ..nurseries import run_thread_to_completion
from ._batching import DecodeBatch, DecodeBatchScheduler

__all__ = ["run_decode_step"]

_log = logging.getLogger("encdisagg.decode")


async def run_decode_step(
    core: DecodeBatchScheduler,
    forward: Callable[[DecodeBatch], Sequence[int]],
    *,
    limiter: anyio.CapacityLimiter | None = None,
    in_thread: bool = True,
) -> DecodeBatch | None:
    """Decide one step (:meth:`~DecodeBatchScheduler.schedule_step`), run ``forward`` on its
    batch in a worker thread, and apply the result. A checkpoint.

    ``forward`` (blocking) returns one next token per request of the batch, in batch order.
    If it raises, the batch's requests fail (slots and pages freed) and the error is logged.
    If the caller is cancelled, it returns only once ``forward`` returned, and the result is
    dropped: the batch stays as it was before the step (its KV writes at ``kv_len`` are made
    again by the next step), so no request loses or duplicates a token.

    With ``in_thread=False``, ``forward`` runs on the event loop's own thread (for steps so
    short that a thread hop and the contention for the interpreter lock with the loop would
    cost more than they spare it); the result is applied, then the call checkpoints.

    :return: the batch that ran, or ``None`` if no request was ready.
    """
    batch = core.schedule_step()
    if batch is None:
        await anyio.lowlevel.checkpoint()
        return None
    try:
        if in_thread:
            tokens = await run_thread_to_completion(forward, batch, limiter=limiter)
        else:
            tokens = forward(batch)
    except Exception as exc:
        _log.exception("a decode step of %d requests failed", len(batch))
        core.fail_batch(batch, f"decode step failed: {exc!r}")
        return batch
    core.process_batch_result_decode(batch, tokens)
    if not in_thread:
        await anyio.lowlevel.checkpoint()
    return batch
