"""ZmqPushPool's evictions (a socket closed with linger 0 on a failed send) over real ZMQ
sockets, on asyncio and Trio: who fails with it, who does not, and who moves on."""

from __future__ import annotations

import os
from collections.abc import Callable

import anyio
import pytest
import torch
import zmq

from encdisagg import TransferError
from encdisagg.transfer import ZmqPushPool, ZmqReceiver, payload_view

from ._zmq_helpers import NOBODY, TRACKED, TrackingContext, free_tcp_url, image_header

pytestmark = pytest.mark.anyio


async def test_a_send_whose_queue_was_dropped_by_another_failure_fails(
    tracking: TrackingContext,
) -> None:
    first, second = torch.ones(TRACKED, 16).half(), torch.ones(TRACKED, 16).half()
    outcome: list[str] = []
    async with ZmqPushPool(immediate=False, send_timeout_s=30, context=tracking) as pool:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:

                async def survivor() -> None:
                    with pytest.raises(TransferError, match="connection was reset"):
                        await pool.send(NOBODY, image_header("a", TRACKED), payload_view(first))
                    outcome.append("a failed")

                async def victim(scope: anyio.CancelScope) -> None:
                    with scope:
                        await pool.send(NOBODY, image_header("b", TRACKED), payload_view(second))

                tg.start_soon(survivor)
                scope = anyio.CancelScope()
                tg.start_soon(victim, scope)
                await anyio.wait_all_tasks_blocked()
                assert len(tracking.trackers) == 2
                scope.cancel()
    assert outcome == ["a failed"]
    assert all(tracker.done for tracker in tracking.trackers)


async def test_the_next_send_reconnects_after_an_eviction() -> None:
    url = free_tcp_url()
    tensor = torch.randn(TRACKED, 16).half()
    async with ZmqPushPool(immediate=False, send_timeout_s=0.2) as pool:
        with anyio.fail_after(10):
            with pytest.raises(TransferError, match="timed out"):
                await pool.send(url, image_header("early", TRACKED), payload_view(tensor))
            assert pool.endpoints == frozenset()
            async with ZmqReceiver(url) as rx:
                await pool.send(url, image_header("later", TRACKED), payload_view(tensor))
                part = await rx.receive()
    assert part.header.req_id == "later"
    assert part.tensor is not None
    assert torch.equal(part.tensor, tensor)


async def test_a_send_waiting_for_room_moves_to_a_fresh_socket_after_an_eviction(
    tracking: TrackingContext,
) -> None:
    first, second = torch.ones(TRACKED, 16).half(), torch.ones(TRACKED, 16).half()
    async with ZmqPushPool(immediate=False, send_timeout_s=30, context=tracking, sndhwm=1) as pool:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                first_scope, first_returned = anyio.CancelScope(), anyio.Event()

                async def send_first() -> None:
                    with first_scope:
                        await pool.send(NOBODY, image_header("first", TRACKED), payload_view(first))
                    first_returned.set()

                tg.start_soon(send_first)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(
                    pool.send, NOBODY, image_header("second", TRACKED), payload_view(second)
                )
                await anyio.wait_all_tasks_blocked()
                assert len(tracking.trackers) == 1
                # Cancelling the queued send closes its socket, which wakes the send that
                # waits for room: it queues its message on a new socket instead.
                first_scope.cancel()
                await first_returned.wait()
                await anyio.wait_all_tasks_blocked()
                first_tracker, second_tracker = tracking.trackers
                assert first_tracker.done
                assert not second_tracker.done
                assert pool.endpoints == {NOBODY}
                tg.cancel_scope.cancel()
            assert second_tracker.done


async def test_a_send_released_before_another_failure_closed_its_socket_succeeds(
    tracking: TrackingContext,
) -> None:
    """ZMQ let go of the payload (its message was written whole) before another send's
    failure closed the socket, but the send had not looked yet: it did not fail."""
    url = free_tcp_url()
    receiver = tracking.socket(zmq.PULL)
    receiver.setsockopt(zmq.RCVTIMEO, 5000)
    receiver.bind(url)
    tensor = torch.randn(TRACKED, 16).half()
    outcome: list[str] = []
    async with ZmqPushPool(immediate=False, send_timeout_s=30, context=tracking) as pool:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def send() -> None:
                    await pool.send(url, image_header("sent", TRACKED), payload_view(tensor))
                    outcome.append("sent")

                tg.start_soon(send)
                await anyio.wait_all_tasks_blocked()
                (tracker,) = tracking.trackers
                # Blocking the loop: the send cannot look at its release before the close.
                frames = receiver.recv_multipart()
                tracker.wait(5)
                # What a failing send to the same endpoint does to the socket.
                pool._evict(pool._connections[url])
    assert outcome == ["sent"]
    assert bytes(frames[1]) == tensor.numpy().tobytes()
    receiver.close(linger=0)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _until(condition: Callable[[], bool], bound_s: float = 5.0) -> None:
    """Wait (bounded) until ``condition()`` holds."""
    with anyio.fail_after(bound_s):
        while not condition():
            await anyio.sleep(0.01)


async def test_a_receiver_that_went_away_costs_no_socket_after_its_first_refusal() -> None:
    """Receivers that took a push and then closed: ZMQ's next connection attempt to each is
    refused, and the pool closes each socket (and its monitor) then, not at the idle sweep
    a minute later. A receiver that stays keeps its socket."""
    small = torch.ones(4, 16).half()
    async with ZmqPushPool(idle_timeout_s=600) as pool, ZmqReceiver() as staying:
        await pool.send(staying.url, image_header("stay", 4), payload_view(small))
        await staying.receive()
        before = _open_descriptors()
        gone: list[str] = []
        for index in range(8):
            async with ZmqReceiver() as receiver:
                await pool.send(receiver.url, image_header(f"r{index}", 4), payload_view(small))
                assert (await receiver.receive()).header.req_id == f"r{index}"
            gone.append(receiver.url)
        await _until(lambda: pool.endpoints == {staying.url})
        # ZMQ's reaper thread closes a closed socket's descriptors a moment later.
        await _until(lambda: _open_descriptors() <= before)
        await pool.send(staying.url, image_header("still", 4), payload_view(small))
        assert (await staying.receive()).header.req_id == "still"


async def test_a_send_waiting_for_a_receiver_not_listening_yet_keeps_its_socket() -> None:
    """Refusals while a send waits for its receiver do not close the socket under it: the
    receiver binds, and the message arrives."""
    url = free_tcp_url()
    small = torch.ones(4, 16).half()
    async with ZmqPushPool(send_timeout_s=30, refused_grace_s=30) as pool:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(pool.send, url, image_header("late", 4), payload_view(small))
                # Refused at least once, and still there.
                await _until(lambda: url in pool.endpoints)
                connection = pool._connections[url]
                await _until(lambda: connection.refused)
                assert pool.endpoints == {url}
                async with ZmqReceiver(url) as receiver:
                    assert (await receiver.receive()).header.req_id == "late"
                    await _until(lambda: not connection.refused)
                    assert pool.endpoints == {url}


async def test_sends_to_an_endpoint_that_keeps_refusing_fail_after_the_grace() -> None:
    """Nothing listens at the URL: every send waiting on it fails once the endpoint has
    refused for the grace, long before the send timeout, and its socket is gone."""
    url = free_tcp_url()
    small = torch.ones(4, 16).half()
    failures: list[str] = []
    async with ZmqPushPool(send_timeout_s=600, refused_grace_s=0.2) as pool:

        async def push(req_id: str) -> None:
            with pytest.raises(TransferError, match="refused every connection attempt") as caught:
                await pool.send(url, image_header(req_id, 4), payload_view(small))
            assert caught.value.req_id == req_id
            failures.append(req_id)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for req_id in ("first", "second", "third"):
                    group.start_soon(push, req_id)
        assert sorted(failures) == ["first", "second", "third"]
        assert pool.endpoints == frozenset()
        # The endpoint is not remembered as dead: a receiver that binds there later is
        # reached by the next send.
        async with ZmqReceiver(url) as receiver:
            with anyio.fail_after(10):
                await pool.send(url, image_header("back", 4), payload_view(small))
                assert (await receiver.receive()).header.req_id == "back"


def test_a_negative_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="refused_grace_s"):
        ZmqPushPool(refused_grace_s=-1)
