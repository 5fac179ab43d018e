"""wait_released: the event-driven wait for ZMQ to let go of a zero-copy frame.

A ``MessageTracker`` over a plain ``threading.Event`` stands in for a frame, so each test
decides when "ZMQ" releases it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import zmq

from encdisagg import TransferError
from encdisagg.transfer import Hold
from encdisagg.transfer._zmq._release import wait_released

pytestmark = pytest.mark.anyio


@pytest.fixture
def released() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # never leave a waiter thread blocked past the test


def _wait(
    tracker: zmq.MessageTracker,
    drop: Callable[[], None] = lambda: None,
    *,
    drop_bound_s: float = 10.0,
    thread_bound_s: float = 30.0,
    on_still_held: Callable[[Hold], None] | None = None,
) -> Any:
    return wait_released(
        tracker,
        "the test send",
        drop=drop,
        drop_bound_s=drop_bound_s,
        thread_bound_s=thread_bound_s,
        limiter=anyio.CapacityLimiter(1),
        on_still_held=on_still_held,
    )


async def test_a_released_frame_needs_no_thread(thread_calls: list[object]) -> None:
    done = threading.Event()
    done.set()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await _wait(zmq.MessageTracker(done))  # no checkpoint, so not cancelled either
    assert thread_calls == []


async def test_returns_when_the_release_is_reported(
    released: threading.Event, thread_calls: list[object]
) -> None:
    outcome: list[str] = []

    async def wait() -> None:
        await _wait(zmq.MessageTracker(released))
        outcome.append("returned")

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        assert outcome == []
        released.set()
    assert outcome == ["returned"]
    assert len(thread_calls) == 1


async def test_a_cancelled_wait_drops_then_waits_for_the_release_in_the_same_thread(
    released: threading.Event, thread_calls: list[object]
) -> None:
    events: list[str] = []

    def drop() -> None:
        events.append("dropped")
        released.set()  # as closing the socket makes ZMQ free the frame

    async def wait() -> None:
        try:
            await _wait(zmq.MessageTracker(released), drop)
        finally:
            events.append(f"returned, released={released.is_set()}")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert events == ["dropped", "returned, released=True"]
    assert len(thread_calls) == 1


async def test_cancelling_twice_changes_nothing(released: threading.Event) -> None:
    events: list[str] = []
    outer, inner = anyio.CancelScope(), anyio.CancelScope()

    async def wait() -> None:
        with outer, inner:
            try:
                await _wait(zmq.MessageTracker(released), lambda: events.append("dropped"))
            finally:
                events.append(f"returned, released={released.is_set()}")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            inner.cancel()
            await anyio.wait_all_tasks_blocked()
            outer.cancel()
            await anyio.wait_all_tasks_blocked()
            assert events == ["dropped"]  # still waiting for the release, once
            released.set()
    assert events == ["dropped", "returned, released=True"]


@pytest.mark.virtual_time
async def test_a_frame_never_released_after_the_drop_is_logged_and_given_up(
    released: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    held: list[Hold] = []
    with caplog.at_level(logging.ERROR, logger="encdisagg.transfer"):
        with anyio.move_on_after(1) as scope:
            await _wait(
                zmq.MessageTracker(released),
                drop_bound_s=5.0,
                on_still_held=held.append,
            )
        assert scope.cancelled_caught
    [record] = caplog.records
    assert "still references the payload 5.0 s after" in record.getMessage()
    # The caller gets a hold on the payload, to keep that memory out of reuse; a tracker
    # that can never say it was released keeps it held for good.
    [hold] = held
    assert not hold.settled


async def test_a_thread_bound_that_runs_out_drops_and_fails(released: threading.Event) -> None:
    dropped: list[str] = []
    with pytest.raises(TransferError, match=r"did not release the payload within 0\.01 s"):
        await _wait(
            zmq.MessageTracker(released),
            lambda: dropped.append("dropped"),
            thread_bound_s=0.01,
            on_still_held=lambda hold: dropped.append("held"),
        )
    assert dropped == ["dropped", "held"]
