"""Waiting, without polling, for ZMQ to let go of a zero-copy frame.

pyzmq reports a released frame from its garbage-collector thread: that thread sets the
``threading.Event`` behind the frame's :class:`zmq.MessageTracker`, then drops its reference
to the buffer object the frame was made from. No event loop can await the event, but the
buffer object's finalizer runs in that same thread right after it was set: a frame sent by
:func:`send_signalled` is made from a fresh view whose finalizer wakes the loop through a
:class:`~encdisagg.nurseries.ThreadSafeEvent`, so the common case costs no worker thread at
all. The tracker stays the authority: a wake-up is believed only if the tracker says done,
and a frame not released within a short grace period (a slow receiver; or a pyzmq that kept
its reference longer) is waited for as any other, by one worker thread blocking in
``tracker.wait()``. That thread touches nothing but the event, never the frame's memory,
so abandoning it is safe; the caller keeps the payload referenced until the release anyway.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any, Final

import anyio
import anyio.to_thread
import zmq

from ..._errors import TransferError
from ...nurseries import ThreadSafeEvent
from .._holds import Hold

__all__ = ["SignalledTracker", "send_signalled", "wait_released"]

logger = logging.getLogger(__name__)

# How long a send waits for the finalizer's wake-up before it also starts a worker thread on
# the tracker: far longer than a loopback send of 64 MiB, far shorter than any send bound.
_SIGNAL_GRACE_S: Final = 1.0
_LET_GO: Final = "ZMQ let go of the payload"


class _ReleaseSignal:
    """Fired by the payload view's finalizer, in pyzmq's thread, once ZMQ dropped the frame:
    wakes the waiting send and settles the holds taken on the payload meanwhile."""

    __slots__ = ("_let_go", "released")

    def __init__(self, released: ThreadSafeEvent) -> None:
        self.released = released
        # The frame itself, held by ZMQ until the finalizer fires: its callbacks settle the
        # holds taken on the payload (at once, for one taken after the release).
        self._let_go = Hold("a zero-copy frame")

    def fire(self) -> None:
        self.released.set_from_thread()
        self._let_go.settle(_LET_GO)

    def settle_when_fired(self, hold: Hold) -> None:
        self._let_go.on_settled(lambda _: hold.settle(_LET_GO))


class SignalledTracker(zmq.MessageTracker):
    """A frame's tracker, plus the signal its buffer's finalizer fires (see the module)."""

    def __init__(self, tracker: zmq.MessageTracker, signal: _ReleaseSignal) -> None:
        super().__init__(tracker)
        self.signal = signal

    @property
    def released(self) -> ThreadSafeEvent:
        return self.signal.released


def send_signalled(
    sock: zmq.Socket[Any],
    payload: memoryview,
    flags: int,
    schedule: Callable[[Callable[[], object]], object] | None = None,
) -> zmq.MessageTracker:
    """Send ``payload`` zero-copy and tracked, as ``sock.send(payload, flags, copy=False,
    track=True)``; the tracker returned also wakes :func:`wait_released` without a thread.
    Not a checkpoint; call it on the event loop (``schedule``: that loop's
    :meth:`~encdisagg.nurseries.ThreadSafeEvent.loop_scheduler`, if the caller has it)."""
    signal = _ReleaseSignal(ThreadSafeEvent(schedule))
    # Our own view: nothing but pyzmq holds it once the send returned, so its finalizer
    # runs when pyzmq drops it. (The caller's payload object lives on.)
    view = memoryview(payload)
    weakref.finalize(view, signal.fire)
    tracker = sock.send(view, flags, copy=False, track=True)
    del view
    return SignalledTracker(tracker, signal)


def _released(tracker: zmq.MessageTracker) -> bool:
    # Read afresh: a type checker takes ``tracker.done`` for False after the first check.
    return tracker.done


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
    on_still_held: Callable[[Hold], None] | None = None,
    held_bytes: int = 0,
) -> None:
    """Return once ZMQ no longer references the frame ``tracker`` tracks.

    Returns at once, without a checkpoint, if it was released already. A
    :class:`SignalledTracker` is then awaited on the loop alone for up to a second; any
    other tracker (or one still held after that) in one worker thread (taken from
    ``limiter``), at most ``thread_bound_s``.

    If the caller is cancelled meanwhile, ``drop()`` (which must make ZMQ let go, e.g. by
    closing the socket with linger 0) is called, the wait goes on in the same thread,
    shielded, for at most ``drop_bound_s``, and only then the cancellation propagates.
    Should the frame still be held by then, that is logged, ``on_still_held(hold)`` is
    called with a :class:`~encdisagg.transfer.Hold` on the payload (``held_bytes``), settled
    once ZMQ lets go of it (never, for a tracker this module did not make: the memory is
    then held for good), and the thread abandoned.

    :raises TransferError: if ``thread_bound_s`` ran out before the release (after calling
        ``drop()``). Pick it longer than any deadline of the caller: it only keeps a thread
        from blocking forever.
    """
    if tracker.done:
        return
    if isinstance(tracker, SignalledTracker):
        try:
            with anyio.move_on_after(_SIGNAL_GRACE_S):
                await tracker.released.wait()
        except BaseException:
            await _drop_and_wait(tracker, tracker.released, what, drop, drop_bound_s)
            _hold_if_held(tracker, what, held_bytes, on_still_held)
            raise
        if _released(tracker):  # a wake-up is believed only if the tracker agrees
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
            await _drop_and_wait(tracker, released, what, drop, drop_bound_s)
            watch_scope.cancel()
            _hold_if_held(tracker, what, held_bytes, on_still_held)
            raise
    if not tracker.done:
        drop()
        _hold_if_held(tracker, what, held_bytes, on_still_held)
        raise TransferError(f"{what}: ZMQ did not release the payload within {thread_bound_s} s")


def _hold_if_held(
    tracker: zmq.MessageTracker,
    what: str,
    nbytes: int,
    on_still_held: Callable[[Hold], None] | None,
) -> None:
    """ZMQ still references the payload: hand its owner a hold, settled on the release."""
    if tracker.done or on_still_held is None:
        return
    hold = Hold(f"the {nbytes}-byte payload of the {what}", nbytes)
    on_still_held(hold)
    if isinstance(tracker, SignalledTracker):
        tracker.signal.settle_when_fired(hold)


async def _drop_and_wait(
    tracker: zmq.MessageTracker,
    released: anyio.Event | ThreadSafeEvent,
    what: str,
    drop: Callable[[], None],
    drop_bound_s: float,
) -> None:
    """The send gives up: make ZMQ let go, and wait (shielded, bounded) until it did."""
    drop()
    with anyio.move_on_after(drop_bound_s, shield=True):
        await released.wait()
    if not tracker.done:
        logger.error(
            "%s: ZMQ still references the payload %s s after its socket was closed",
            what,
            drop_bound_s,
        )
