"""SglangPusher: one multipart message per push, to a real ZMQ PULL socket."""

from __future__ import annotations

import anyio.to_thread
import pytest
import zmq

from encdisagg import TransferError
from encdisagg.transfer._sglang_push import SglangPusher

pytestmark = pytest.mark.anyio


async def test_frames_arrive_as_one_message_and_the_memory_is_free_on_return() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 20_000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with SglangPusher() as pusher:
            payload = bytearray(b"x" * 100_000)
            await pusher.push(f"tcp://127.0.0.1:{port}", [b"head", memoryview(payload)], what="t")
            payload[:] = b"y" * len(payload)  # ours again: ZMQ copied it
            frames = await anyio.to_thread.run_sync(pull.recv_multipart)
    finally:
        pull.close(linger=0)
        context.term()
    assert frames == [b"head", b"x" * 100_000]


async def test_nobody_listening_fails_within_the_bound_and_closed_refuses() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()  # a port nobody listens on now
    pusher = SglangPusher(send_timeout_s=0.2)
    async with pusher:
        with pytest.raises(TransferError, match=r"nobody took the message within 0\.1 s"):
            await pusher.push(f"tcp://127.0.0.1:{port}", [b"h"], what="t", timeout_s=0.1)
    with pytest.raises(TransferError, match="closed"):
        await pusher.push(f"tcp://127.0.0.1:{port}", [b"h"], what="t")
