"""The decode scheduler's shell: one batched step around the synchronous core.

:func:`run_decode_step` runs the forward in a worker thread (a checkpoint);
:func:`run_decode_step_inline` runs it on the calling thread and never awaits, for models
whose step is shorter than a thread hop, leaving the caller to decide when to checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import anyio
import anyio.lowlevel

from ..nurseries import run_thread_to_completion
from ._batching import DecodeBatch, DecodeBatchScheduler

__all__ = ["run_decode_step", "run_decode_step_inline"]

_log = logging.getLogger("encdisagg.decode")


async def run_decode_step(
    core: DecodeBatchScheduler,
    forward: Callable[[DecodeBatch], Sequence[int]],
    *,
    limiter: anyio.CapacityLimiter | None = None,
) -> DecodeBatch | None:
    """Decide one step (:meth:`~DecodeBatchScheduler.schedule_step`), run ``forward`` on its
    batch in a worker thread, and apply the result. A checkpoint.

    ``forward`` (blocking) returns one next token per request of the batch, in batch order.
    If it raises, the batch's requests fail (slots and pages freed) and the error is logged.
    If the caller is cancelled, it returns only once ``forward`` returned, and the result is
    dropped: the batch stays as it was before the step (its KV writes at ``kv_len`` are made
    again by the next step), so no request loses or duplicates a token.

    :return: the batch that ran, or ``None`` if no request was ready.
    """
    batch = core.schedule_step()
    if batch is None:
        await anyio.lowlevel.checkpoint()
        return None
    try:
        tokens = await run_thread_to_completion(forward, batch, limiter=limiter)
    except Exception as exc:
        _fail(core, batch, exc)
        return batch
    core.process_batch_result_decode(batch, tokens)
    return batch


def run_decode_step_inline(
    core: DecodeBatchScheduler, forward: Callable[[DecodeBatch], Sequence[int]]
) -> DecodeBatch | None:
    """:func:`run_decode_step` with ``forward`` called on this thread. Not a checkpoint.

    For steps so short that a thread hop, and waiting for the interpreter lock behind the
    event loop's own work, would cost more than they spare the loop. The caller checkpoints
    between steps as its latency budget allows.
    """
    batch = core.schedule_step()
    if batch is None:
        return None
    try:
        tokens = forward(batch)
    except Exception as exc:
        _fail(core, batch, exc)
        return batch
    core.process_batch_result_decode(batch, tokens)
    return batch


def _fail(core: DecodeBatchScheduler, batch: DecodeBatch, exc: Exception) -> None:
    _log.exception("a decode step of %d requests failed", len(batch), exc_info=exc)
    core.fail_batch(batch, f"decode step failed: {exc!r}")
