"""ZmqPushPool with a foreign header frame (SGLang's): sent as given, before the payload, to
a real ZMQ PULL socket."""

from __future__ import annotations

import anyio.to_thread
import pytest
import zmq

from encdisagg import TransferError
from encdisagg.transfer import ZmqPushPool
from encdisagg.transfer._wire import ForeignHeader

pytestmark = pytest.mark.anyio


async def test_frames_arrive_as_one_message_and_the_memory_is_free_on_return() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 20_000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with ZmqPushPool() as pool:
            payload = bytearray(b"x" * 100_000)
            header = ForeignHeader("r", 0, b"head")
            await pool.send(f"tcp://127.0.0.1:{port}", header, memoryview(payload))
            payload[:] = b"y" * len(payload)  # ours again: ZMQ let go of it
            frames = await anyio.to_thread.run_sync(pull.recv_multipart)
    finally:
        pull.close(linger=0)
        context.term()
    assert frames == [b"head", b"x" * 100_000]


async def test_nobody_listening_fails_within_the_bound_and_closed_refuses() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()  # a port nobody listens on now
    header = ForeignHeader("r", 0, b"h")
    pool = ZmqPushPool(send_timeout_s=0.1)
    async with pool:
        with pytest.raises(TransferError, match=r"req_id 'r' part 0 .* timed out after 0\.1 s"):
            await pool.send(f"tcp://127.0.0.1:{port}", header, None)
    with pytest.raises(TransferError, match="closed"):
        await pool.send(f"tcp://127.0.0.1:{port}", header, None)
