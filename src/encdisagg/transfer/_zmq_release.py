"""Waiting, without polling, for ZMQ to let go of a zero-copy frame.

pyzmq reports a released frame from its garbage-collector thread, which sets the
``threading.Event`` behind the frame's :class:`zmq.MessageTracker`; no event loop can await
that. One worker thread per tracked send therefore blocks in ``tracker.wait()``, and its
return wakes the send. The thread touches nothing but that event, never the frame's memory,
so abandoning it is safe; the caller keeps the payload referenced until the release anyway.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import anyio
import anyio.to_thread
import zmq

from .._errors import TransferError

__all__ = ["wait_released"]

logger = logging.getLogger(__name__)


def _block_until_released(tracker: zmq.MessageTracker, bound_s: float) -> None:
    with contextlib.suppress(zmq.NotDone):  # the caller looks at tracker.done
        tracker.wait(bound_s)


async def wait_released(
    tracker: zmq.MessageTracker,
    what: str,
    *,
    drop: Callable[[], None],
    drop_bound_s: float,
    thread_bound_s: float,
    limiter: anyio.CapacityLimiter,
    on_still_held: Callable[[], None] | None = None,
) -> None:
    """Return once ZMQ no longer references the frame ``tracker`` tracks.

    Returns at once, without a checkpoint, if it was released already; otherwise it waits in
    one worker thread (taken from ``limiter``), at most ``thread_bound_s``.

    If the caller is cancelled meanwhile, ``drop()`` (which must make ZMQ let go, e.g. by
    closing the socket with linger 0) is called, the wait goes on in the same thread,
    shielded, for at most ``drop_bound_s``, and only then the cancellation propagates.
    Should the frame still be held by then, that is logged, ``on_still_held()`` is called
    (the caller must then keep the memory out of reuse for good) and the thread abandoned.

    :raises TransferError: if ``thread_bound_s`` ran out before the release (after calling
        ``drop()``). Pick it longer than any deadline of the caller: it only keeps a thread
        from blocking forever.
    """
    if tracker.done:
        return
    released = anyio.Event()
    # Shielded, so that a cancelled caller goes on waiting on this same thread after drop();
    # cancelled (abandoning the thread) only once that bounded wait is over.
    watch_scope = anyio.CancelScope(shield=True)

    async def watch() -> None:
        with watch_scope:
            await anyio.to_thread.run_sync(
                _block_until_released,
                tracker,
                thread_bound_s,
                abandon_on_cancel=True,
                limiter=limiter,
            )
        released.set()

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        try:
            await released.wait()
        except BaseException:
            drop()
            with anyio.move_on_after(drop_bound_s, shield=True):
                await released.wait()
            watch_scope.cancel()
            if not tracker.done:
                logger.error(
                    "%s: ZMQ still references the payload %s s after its socket was closed",
                    what,
                    drop_bound_s,
                )
                if on_still_held is not None:
                    on_still_held()
            raise
    if not tracker.done:
        drop()
        if on_still_held is not None:
            on_still_held()
        raise TransferError(f"{what}: ZMQ did not release the payload within {thread_bound_s} s")
