"""The raw loops the transfer benchmark measures the Encoder against: the same transports with
nothing of ours in between (or, for the one-task-per-message ZMQ sender, the least of ours
an async sender needs)."""

from __future__ import annotations

import time
from typing import Any

from _transfer_peers import ack_wait


def mooncake_raw(engine: Any, session: str, remote: int, local: int, size: int, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        rc = engine.transfer_sync_write(session, local, remote, size)
        if rc != 0:
            raise RuntimeError(f"raw transfer_sync_write failed (rc={rc})")
    return size * n / (time.perf_counter() - start)


async def mooncake_raw_hopped(
    engine: Any, session: str, remote: int, local: int, size: int, n: int
) -> float:
    """Raw, but each write in a worker thread, as an event loop makes a blocking call (the
    Encoder's way before its writes were submitted and polled)."""
    import anyio.to_thread

    start = time.perf_counter()
    for _ in range(n):
        rc = await anyio.to_thread.run_sync(
            engine.transfer_sync_write, session, local, remote, size
        )
        if rc != 0:
            raise RuntimeError(f"raw transfer_sync_write failed (rc={rc})")
    return size * n / (time.perf_counter() - start)


async def mooncake_submit_poll(
    engine: Any, session: str, remote: int, local: int, size: int, n: int
) -> float:
    """Raw, but awaited on the event loop: each write submitted (``transfer_submit_write``)
    and its status checked once per turn of the loop until done, as the Encoder waits for
    its writes. Nothing else: no argument or range checks, no cancellation shield, no
    bookkeeping. The least any async sender whose sends each return once the write ended
    does; the plain loop spins in ``transfer_sync_write`` instead."""
    from encdisagg.nurseries import loop_checkpoint

    checkpoint = loop_checkpoint()
    start = time.perf_counter()
    for _ in range(n):
        batch = engine.transfer_submit_write(session, local, remote, size)
        while (rc := engine.transfer_check_status(batch)) == 0:
            await checkpoint()
        if rc != 1:
            raise RuntimeError(f"raw transfer_submit_write failed (rc={rc})")
    return size * n / (time.perf_counter() - start)


def mooncake_raw_distinct(engine: Any, session: str, remote: int, sources: list[Any]) -> float:
    """Raw, but each message from its own buffer (all registered before the clock starts), as
    the Encoder sends a distinct embedding each time: the one-buffer loop re-reads memory
    that stays in the CPU caches, which N distinct embeddings do not."""
    size = sources[0].nbytes
    for source in sources:
        if engine.register_memory(source.ctypes.data, size) != 0:
            raise RuntimeError("raw register_memory failed")
    try:
        start = time.perf_counter()
        for source in sources:
            rc = engine.transfer_sync_write(session, source.ctypes.data, remote, size)
            if rc != 0:
                raise RuntimeError(f"raw transfer_sync_write failed (rc={rc})")
        return size * len(sources) / (time.perf_counter() - start)
    finally:
        for source in sources:
            engine.unregister_memory(source.ctypes.data)


def distinct_sources(size: int, n: int, seed: int) -> list[Any]:
    import numpy as np

    # Filled, so their pages exist, before the clock starts.
    return [np.full(size, (seed + index) % 256, dtype=np.uint8) for index in range(n)]


class ZmqRawSender:
    """Bare pyzmq pushes of ``[header, payload]`` to the benchmark's ZMQ receiver.

    :param push: a PUSH socket connected to the receiver (blocking sends).
    :param ack: the PULL socket the receiver acknowledges each message on.
    :param source: bytes to send from (at least the largest message).
    :param url: the receiver's URL, for the one-task-per-message sender's own socket.
    :param context: the ZMQ context to make that socket in.
    :param row_bytes: bytes per embedding row, and ``hidden`` its width, for the header.
    """

    def __init__(
        self,
        push: Any,
        ack: Any,
        source: Any,
        *,
        url: str,
        context: Any,
        row_bytes: int,
        hidden: int,
    ) -> None:
        import zmq

        self._row_bytes = row_bytes
        self._hidden = hidden
        self._push = push
        self._ack = ack
        self._source = source
        # The one-task-per-message sender queues without blocking, as the Encoder's pool
        # does, so its socket queues as many messages as the Encoder's (256).
        self._async_push = context.socket(zmq.PUSH)
        self._async_push.setsockopt(zmq.LINGER, 0)
        self._async_push.setsockopt(zmq.SNDHWM, 256)
        self._async_push.copy_threshold = 0
        self._async_push.connect(url)

    def close(self) -> None:
        self._async_push.close()

    def loop(self, size: int, n: int, pipelined: bool, sources: list[Any] | None = None) -> float:
        """N messages in a plain loop: each waited for (ZMQ's tracker) before the next, or
        all queued and then waited for; bytes/s until the receiver acknowledged all."""
        header = self._header(size)
        payloads = (
            [memoryview(buf) for buf in sources] if sources else [memoryview(self._source[:size])]
        )
        start = time.perf_counter()
        trackers = []
        for index in range(n):
            payload = payloads[index % len(payloads)]
            tracker = self._push.send_multipart([header, payload], copy=False, track=True)
            if pipelined:
                trackers.append(tracker)
            else:
                tracker.wait()
        for tracker in trackers:
            tracker.wait()
        ack_wait(self._ack, n)
        return size * n / (time.perf_counter() - start)

    async def one_task_per_message(self, size: int, n: int, pipelined: bool) -> float:
        """N messages from distinct slices of the source (repeating once they ran out), each
        a send that returns once ZMQ let go of its payload, woken by the payload view's
        finalizer (the Encoder's own mechanism): one task per message when pipelined, one
        await after another when not. Nothing else: no deadline, no checks, no bookkeeping.
        Bytes/s until the receiver acknowledged all.

        The least any async sender whose sends each return on the release does; the
        plain loop is woken by no message at all."""
        import anyio
        import zmq

        from encdisagg.nurseries import ThreadSafeEvent
        from encdisagg.transfer._zmq._release import send_signalled

        header = self._header(size)
        push = self._async_push
        schedule = ThreadSafeEvent.loop_scheduler()

        async def send(payload: memoryview) -> None:
            push.send(header, zmq.NOBLOCK | zmq.SNDMORE)
            tracker = send_signalled(push, payload, zmq.NOBLOCK, schedule)
            await tracker.released.wait()

        count = max(1, len(self._source) // size)
        payloads = [memoryview(self._source[(i % count) * size :][:size]) for i in range(n)]
        start = time.perf_counter()
        if pipelined:
            async with anyio.create_task_group() as group:
                for payload in payloads:
                    group.start_soon(send, payload)
        else:
            for payload in payloads:
                await send(payload)
        ack_wait(self._ack, n)
        return size * n / (time.perf_counter() - start)

    def _header(self, size: int) -> bytes:
        import msgpack

        shape = [size // self._row_bytes, self._hidden]
        return msgpack.packb({"v": 1, "req_id": "raw", "shape": shape})
