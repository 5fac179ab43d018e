"""ZmqPushPool and ZmqReceiver over real ZMQ sockets, on asyncio and Trio."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.to_thread
import msgpack
import pytest
import torch
import zmq

from encdisagg import BadRequestError, TransferError
from encdisagg.transfer import (
    EmbeddingHeader,
    ZmqPushPool,
    ZmqReceiver,
    encode_header,
    payload_view,
)

from ._zmq_helpers import NOBODY, TRACKED, TrackingContext, free_tcp_url, image_header

pytestmark = pytest.mark.anyio

# Most tests here pin down what happens to messages ZMQ holds and cannot deliver: their pools
# queue on connections that never complete (immediate=False). The default pool waits for a
# completed connection instead (see the test of that at the end of this file).


@pytest.fixture(autouse=True, scope="module")
def _collect_leaks() -> Iterator[None]:
    # A socket or context left unclosed warns (ResourceWarning) when collected; collecting
    # here makes such a leak fail the run (warnings are errors) instead of going unseen.
    yield
    gc.collect()


def _error_header(req_id: str) -> EmbeddingHeader:
    return EmbeddingHeader(
        req_id=req_id,
        num_parts=2,
        part_idx=1,
        modality="image",
        shape=(0, 0),
        dtype="float16",
        token_counts=(),
        grid=(),
        error="image 0 could not be decoded",
        status=400,
    )


async def test_round_trip_is_byte_exact_and_zero_copy() -> None:
    small = torch.randn(300, 64).half()
    large = torch.randn(4096, 256).half()  # 2 MiB: well past ZMQ's inline sizes
    async with ZmqReceiver() as rx, ZmqPushPool(immediate=False, send_timeout_s=10) as pool:
        assert rx.url.startswith("tcp://127.0.0.1:")
        with anyio.fail_after(10):
            for name, tensor in [("small", small), ("large", large)]:
                header = image_header(name, tensor.shape[0], tensor.shape[1])
                await pool.send(rx.url, header, payload_view(tensor))
                part = await rx.receive()
                assert part.header == header
                assert part.tensor is not None
                assert part.tensor.dtype == torch.float16
                assert torch.equal(part.tensor.view(torch.int16), tensor.view(torch.int16))
        assert pool.endpoints == {rx.url}


async def test_error_part_round_trip() -> None:
    async with ZmqReceiver() as rx, ZmqPushPool(immediate=False, send_timeout_s=10) as pool:
        with anyio.fail_after(10):
            await pool.send(rx.url, _error_header("bad"), None)
            part = await rx.receive()
    assert part.tensor is None
    assert part.header == _error_header("bad")
    assert part.header.status == 400


async def test_concurrent_sends_keep_header_and_payload_paired() -> None:
    count = 24
    tensors = {
        f"req-{i}": torch.full((1 + 97 * i, 64), float(i), dtype=torch.float16)
        for i in range(count)
    }
    received: dict[str, torch.Tensor] = {}
    async with (
        ZmqReceiver() as rx,
        ZmqPushPool(immediate=False, send_timeout_s=10, sndhwm=4) as pool,
    ):
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for req_id, tensor in tensors.items():
                    header = image_header(req_id, tensor.shape[0], 64)
                    tg.start_soon(pool.send, rx.url, header, payload_view(tensor))
                for _ in range(count):
                    part = await rx.receive()
                    assert part.tensor is not None
                    received[part.header.req_id] = part.tensor
    assert received.keys() == tensors.keys()
    for req_id, tensor in tensors.items():
        assert torch.equal(received[req_id], tensor), req_id


async def test_send_to_nobody_times_out_and_releases_the_payload(
    tracking: TrackingContext,
) -> None:
    payload = torch.ones(TRACKED, 16, dtype=torch.float16)
    async with ZmqPushPool(immediate=False, send_timeout_s=0.2, context=tracking) as pool:
        started = anyio.current_time()
        with (
            anyio.fail_after(5),
            pytest.raises(TransferError, match=r"timed out after 0\.2 s") as caught,
        ):
            await pool.send(NOBODY, image_header("late", TRACKED), payload_view(payload))
        assert anyio.current_time() - started >= 0.2
        assert caught.value.req_id == "late"
        assert tracking.trackers
        assert all(tracker.done for tracker in tracking.trackers)
        assert pool.endpoints == frozenset()


async def test_cancelled_while_queued_returns_only_after_zmq_released_the_payload(
    tracking: TrackingContext,
) -> None:
    payload = torch.ones(TRACKED, 16, dtype=torch.float16)
    async with ZmqPushPool(immediate=False, send_timeout_s=30, context=tracking) as pool:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(pool.send, NOBODY, image_header("r", TRACKED), payload_view(payload))
                await anyio.wait_all_tasks_blocked()
                # Queued on a socket that cannot deliver: ZMQ holds the payload.
                assert pool.endpoints == {NOBODY}
                [tracker] = tracking.trackers
                assert not tracker.done
                tg.cancel_scope.cancel()
            # The send returned (cancelled) only once ZMQ let go of the payload.
            assert tracker.done
            assert pool.endpoints == frozenset()


async def test_cancelled_while_waiting_for_room_leaves_the_socket_alone(
    tracking: TrackingContext,
) -> None:
    first, second = torch.ones(TRACKED, 16).half(), torch.ones(TRACKED, 16).half()
    async with ZmqPushPool(immediate=False, send_timeout_s=30, context=tracking, sndhwm=1) as pool:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                first_scope, second_scope = anyio.CancelScope(), anyio.CancelScope()

                async def send(scope: anyio.CancelScope, req_id: str, tensor: torch.Tensor) -> None:
                    with scope:
                        await pool.send(NOBODY, image_header(req_id, TRACKED), payload_view(tensor))

                tg.start_soon(send, first_scope, "first", first)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(send, second_scope, "second", second)
                await anyio.wait_all_tasks_blocked()
                # The queue (high-water mark 1) is full: the second waits for room.
                [first_tracker] = tracking.trackers
                second_scope.cancel()
                await anyio.wait_all_tasks_blocked()
                # Nothing of the second reached ZMQ, so its cancellation closed nothing.
                assert pool.endpoints == {NOBODY}
                assert tracking.trackers == [first_tracker]
                assert not first_tracker.done
                first_scope.cancel()
            assert first_tracker.done
            assert pool.endpoints == frozenset()


async def test_the_receiver_survives_malformed_messages() -> None:
    header = image_header("ok", 4)
    good = encode_header(header)
    payload = bytes(4 * 16 * 2)
    malformed: list[tuple[list[bytes], str]] = [
        ([b"\xc1garbage", payload], "not valid msgpack"),
        ([msgpack.packb({"v": 1})], "missing field"),
        ([good, payload[:-2]], "needs 128"),
        ([good], "payload of req_id 'ok' part 0 is missing"),
        ([good, payload, payload], "has 3 frames"),
        ([encode_header(_error_header("e")), payload], "carries a payload"),
        ([good, bytes(4096)], "limit is 1024"),
    ]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    raw = context.socket(zmq.PUSH)
    try:
        async with ZmqReceiver(max_payload_bytes=1024) as rx:
            raw.connect(rx.url)
            with anyio.fail_after(10):
                for frames, message in malformed:
                    raw.send_multipart(frames)
                    with pytest.raises(BadRequestError, match=message):
                        await rx.receive()
                raw.send_multipart([good, payload])
                part = await rx.receive()
        assert part.header == header
    finally:
        raw.close(linger=0)
        context.term()


async def test_closing_the_receiver_wakes_a_waiting_receive() -> None:
    rx = ZmqReceiver()
    with pytest.raises(RuntimeError, match="entered"):
        _ = rx.url
    outcome: list[str] = []

    async def receive() -> None:
        with pytest.raises(anyio.ClosedResourceError):
            await rx.receive()
        outcome.append("woken")

    async with rx, anyio.create_task_group() as tg:
        tg.start_soon(receive)
        await anyio.wait_all_tasks_blocked()
        await rx.aclose()
    assert outcome == ["woken"]
    with pytest.raises(anyio.ClosedResourceError):
        await rx.receive()


async def test_closing_the_pool_aborts_running_sends_after_release(
    tracking: TrackingContext,
) -> None:
    payload = torch.ones(TRACKED, 16, dtype=torch.float16)
    outcome: list[str] = []
    pool = ZmqPushPool(immediate=False, send_timeout_s=30, context=tracking)

    async def send() -> None:
        with pytest.raises(TransferError, match="push pool closed"):
            await pool.send(NOBODY, image_header("r", TRACKED), payload_view(payload))
        outcome.append("aborted")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            await anyio.wait_all_tasks_blocked()
            await pool.aclose()
            # aclose() waited for the send to give up, and ZMQ released the payload.
            assert outcome == ["aborted"]
            assert all(tracker.done for tracker in tracking.trackers)
    with pytest.raises(TransferError, match="closed"):
        await pool.send(NOBODY, image_header("r", TRACKED), payload_view(payload))
    await pool.aclose()  # idempotent


async def test_a_payload_that_does_not_match_its_header_is_refused() -> None:
    tensor = torch.ones(8, 16).half()
    async with ZmqPushPool(immediate=False) as pool:
        with pytest.raises(BadRequestError, match="is 256 bytes; shape \\[9, 16\\]"):
            await pool.send(NOBODY, image_header("r", 9), payload_view(tensor))
        with pytest.raises(BadRequestError, match="missing"):
            await pool.send(NOBODY, image_header("r", 8), None)
        with pytest.raises(BadRequestError, match="error part"):
            await pool.send(NOBODY, _error_header("r"), payload_view(tensor))
        with pytest.raises(TransferError, match="cannot connect"):
            await pool.send("not-a-url", image_header("r", 8), payload_view(tensor))
        assert pool.endpoints == frozenset()


@pytest.fixture
def thread_calls(
    thread_calls: list[Callable[..., Any]], monkeypatch: pytest.MonkeyPatch
) -> list[Callable[..., Any]]:
    """The shared recording of worker-thread calls, and anyio.sleep fails: nothing polls."""

    async def no_sleep(delay: float, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"slept {delay} s")

    monkeypatch.setattr(anyio, "sleep", no_sleep)
    return thread_calls


def _release_waits(calls: list[Callable[..., Any]]) -> int:
    return sum(call.__module__ == "encdisagg.transfer._zmq._release" for call in calls)


async def _send_before_anyone_listens(tracking: TrackingContext) -> None:
    """One zero-copy send to a URL nobody listens at yet; a receiver comes once ZMQ holds the
    payload. Checks the send returned only once ZMQ let go, and the bytes arrived."""
    url = free_tcp_url()
    tensor = torch.randn(TRACKED, 16).half()
    outcome: list[bool] = []
    async with ZmqPushPool(immediate=False, send_timeout_s=30, context=tracking) as pool:

        async def send() -> None:
            await pool.send(url, image_header("r", TRACKED), payload_view(tensor))
            outcome.append(tracking.trackers[0].done)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                await anyio.wait_all_tasks_blocked()
                # Nobody listens yet: ZMQ holds the payload, and the send waits for it.
                [tracker] = tracking.trackers
                assert not tracker.done
                assert outcome == []
                async with ZmqReceiver(url) as rx:
                    part = await rx.receive()
    assert outcome == [True]
    assert part.tensor is not None
    assert torch.equal(part.tensor, tensor)


async def test_a_zero_copy_send_returns_once_zmq_released_the_payload(
    tracking: TrackingContext, thread_calls: list[Callable[..., Any]]
) -> None:
    await _send_before_anyone_listens(tracking)
    # The payload view's finalizer woke the send: no polling, no worker thread.
    assert _release_waits(thread_calls) == 0


async def test_a_send_still_held_after_the_grace_waits_for_the_release_in_one_thread(
    tracking: TrackingContext,
    thread_calls: list[Callable[..., Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A grace of 0: the finalizer's wake-up is not waited for, as for a receiver that is slow
    # for longer than the grace. One worker thread then waits on the tracker.
    monkeypatch.setattr("encdisagg.transfer._zmq._release._SIGNAL_GRACE_S", 0)
    await _send_before_anyone_listens(tracking)
    assert _release_waits(thread_calls) == 1


async def test_a_cancelled_zero_copy_send_returns_only_after_the_release(
    tracking: TrackingContext, thread_calls: list[Callable[..., Any]]
) -> None:
    payload = torch.ones(TRACKED, 16, dtype=torch.float16)
    returned: list[bool] = []
    async with ZmqPushPool(immediate=False, send_timeout_s=30, context=tracking) as pool:

        async def send() -> None:
            try:
                await pool.send(NOBODY, image_header("r", TRACKED), payload_view(payload))
            finally:
                returned.append(tracking.trackers[0].done)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                await anyio.wait_all_tasks_blocked()
                assert not tracking.trackers[0].done
                tg.cancel_scope.cancel()
        assert returned == [True]
        assert pool.endpoints == frozenset()
        assert _release_waits(thread_calls) == 0


async def test_a_small_payload_is_copied_and_its_buffer_free_at_once(
    tracking: TrackingContext, thread_calls: list[Callable[..., Any]]
) -> None:
    url = free_tcp_url()
    rows = 2047  # 65,504 bytes: just under the default copy_below_bytes (64 KiB)
    tensor = torch.full((rows, 16), 7.0, dtype=torch.float16)
    async with ZmqPushPool(immediate=False, send_timeout_s=30, context=tracking) as pool:
        with anyio.fail_after(10):
            # Nobody listens yet, and still the send returns: ZMQ queued its own copy.
            await pool.send(url, image_header("small", rows), payload_view(tensor))
            await pool.send(url, _error_header("bad"), None)
            tensor.fill_(-1.0)
            assert tracking.trackers == []  # nothing zero-copy, nothing tracked
            async with ZmqReceiver(url) as rx:
                small, error = await rx.receive(), await rx.receive()
    assert small.tensor is not None
    assert torch.equal(small.tensor, torch.full((rows, 16), 7.0, dtype=torch.float16))
    assert error.header == _error_header("bad")
    assert _release_waits(thread_calls) == 0


async def test_copy_below_bytes_sets_the_zero_copy_threshold(tracking: TrackingContext) -> None:
    below, at = torch.ones(31, 16).half(), torch.ones(32, 16).half()  # 992 and 1024 bytes
    async with ZmqPushPool(
        immediate=False, send_timeout_s=30, context=tracking, copy_below_bytes=1024
    ) as pool:
        with anyio.fail_after(10):
            await pool.send(NOBODY, image_header("below", 31), payload_view(below))
            assert tracking.trackers == []
            async with anyio.create_task_group() as tg:
                tg.start_soon(pool.send, NOBODY, image_header("at", 32), payload_view(at))
                await anyio.wait_all_tasks_blocked()
                [tracker] = tracking.trackers
                assert not tracker.done  # zero-copy: held by ZMQ, the send waits
                tg.cancel_scope.cancel()
            assert tracker.done
    for wrong in (-1, 1.5, True):
        with pytest.raises(ValueError, match="copy_below_bytes"):
            ZmqPushPool(immediate=False, copy_below_bytes=wrong)  # type: ignore[arg-type]


async def test_by_default_nothing_is_queued_for_an_endpoint_nobody_listens_at() -> None:
    small = torch.ones(2, 4, dtype=torch.float16)
    async with ZmqPushPool(send_timeout_s=0.2) as pool:
        assert not pool.send_nowait(NOBODY, image_header("r", 2, 4), payload_view(small))
        with anyio.fail_after(5), pytest.raises(TransferError, match="timed out"):
            await pool.send(NOBODY, image_header("r", 2, 4), payload_view(small))


async def test_send_nowait_queues_a_copied_message_to_a_connected_endpoint() -> None:
    small = torch.arange(8, dtype=torch.float16).reshape(2, 4)
    async with ZmqReceiver() as rx, ZmqPushPool() as pool:
        with anyio.fail_after(5):
            # The first send connects; later ones to the same endpoint need no wait.
            await pool.send(rx.url, image_header("first", 2, 4), payload_view(small))
            assert pool.send_nowait(rx.url, image_header("second", 2, 4), payload_view(small))
            small.fill_(0)  # ZMQ copied it: the buffer is free
            big = torch.ones(TRACKED, 16, dtype=torch.float16)
            assert not pool.send_nowait(rx.url, image_header("big", TRACKED), payload_view(big))
            first, second = await rx.receive(), await rx.receive()
    assert (first.header.req_id, second.header.req_id) == ("first", "second")
    assert second.tensor is not None
    assert torch.equal(second.tensor, torch.arange(8, dtype=torch.float16).reshape(2, 4))
