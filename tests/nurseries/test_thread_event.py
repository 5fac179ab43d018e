from __future__ import annotations

import threading

import anyio
import pytest

from encdisagg.nurseries import ThreadSafeEvent

pytestmark = pytest.mark.anyio


async def test_a_set_from_another_thread_wakes_the_waiter_without_blocking_that_thread() -> None:
    event = ThreadSafeEvent()
    returned = threading.Event()

    def setter() -> None:
        event.set_from_thread()
        # Reached before the loop ran the set: the thread never waits on the loop.
        returned.set()

    thread = threading.Thread(target=setter)
    with anyio.fail_after(10):
        thread.start()
        await event.wait()
    thread.join(10)
    assert returned.is_set()
    assert event.is_set()


async def test_a_set_from_the_loop_thread_takes_effect_at_the_next_checkpoint() -> None:
    event = ThreadSafeEvent()
    event.set_from_thread()
    assert not event.is_set()  # scheduled, not run inline
    with anyio.fail_after(10):
        await event.wait()
    event.set_from_thread()  # twice is harmless
    await anyio.lowlevel.checkpoint()
    assert event.is_set()


async def test_a_cancelled_wait_leaves_the_event_usable() -> None:
    event = ThreadSafeEvent()
    with anyio.move_on_after(0):
        await event.wait()
    assert not event.is_set()
    threading.Thread(target=event.set_from_thread).start()
    with anyio.fail_after(10):
        await event.wait()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_set_after_the_loop_finished_is_ignored(backend: str) -> None:
    async def make() -> ThreadSafeEvent:
        return ThreadSafeEvent()

    event = anyio.run(make, backend=backend)
    event.set_from_thread()  # the loop is gone: nothing to wake, nothing raised


async def test_events_share_one_scheduler_looked_up_once() -> None:
    schedule = ThreadSafeEvent.loop_scheduler()
    events = [ThreadSafeEvent(schedule) for _ in range(3)]
    threads = [threading.Thread(target=event.set_from_thread) for event in events]
    with anyio.fail_after(10):
        for thread in threads:
            thread.start()
        for event in events:
            await event.wait()
    for thread in threads:
        thread.join(10)
    assert all(event.is_set() for event in events)
