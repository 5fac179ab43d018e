"""Worker-thread calls that are never abandoned."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.lowlevel
import anyio.to_thread

__all__ = ["run_thread_to_completion"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


async def run_thread_to_completion(
    func: Callable[[Unpack[Ts]], T],
    *args: *Ts,
    limiter: anyio.CapacityLimiter | None = None,
) -> T:
    """Run ``func(*args)`` in a worker thread and wait until it has returned.

    This is a checkpoint. Unlike an abandoning thread call, cancelling the caller (once or
    many times) does not let it return while the thread still runs: the cancellation is
    delivered right after ``func`` returned, so memory that ``func`` reads or writes is free
    to be released by the time the caller sees ``Cancelled``.

    If ``func`` raises, its exception propagates. If ``func`` returns while a cancellation is
    pending, its result is dropped and the cancellation is raised; so anything ``func``
    acquires that must outlive the call should be recorded by ``func`` itself (for example in
    an object owned by an enclosing scope), not handed back through the return value alone.

    :param limiter: bounds how many such calls run at once (AnyIO's default limiter if omitted).
    """
    result = await anyio.to_thread.run_sync(func, *args, abandon_on_cancel=False, limiter=limiter)
    # Both backends return the result of a non-abandoned call even when a cancellation arrived
    # during it; deliver that cancellation now, after the thread is done.
    await anyio.lowlevel.checkpoint_if_cancelled()
    return result
