"""The AnyIO-native ZMQ sockets of the data-parallel channels, on asyncio and Trio."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq

from encdisagg.server._dp._ipc import IpcSocket, unpack

pytestmark = pytest.mark.anyio


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(0)


async def test_messages_flow_in_order_and_waiters_take_turns(
    context: zmq.Context[Any], tmp_path: Path
) -> None:
    url = f"ipc://{tmp_path}/channel"
    pull = IpcSocket(context, zmq.PULL, url, bind=True)
    push = IpcSocket(context, zmq.PUSH, url, bind=False)
    try:
        received: list[int] = []

        async def receiver() -> None:
            while True:
                received.append(unpack(await pull.receive())["n"])

        async with anyio.create_task_group() as group:
            group.start_soon(receiver)
            group.start_soon(receiver)  # a second waiter on the same socket waits its turn
            for n in range(200):
                await push.send({"n": n})
            with anyio.fail_after(10):
                while len(received) < 200:
                    await anyio.sleep(0.01)
            group.cancel_scope.cancel()
        assert sorted(received) == list(range(200))
    finally:
        push.close()
        pull.close()


async def test_send_nowait_without_a_peer(context: zmq.Context[Any], tmp_path: Path) -> None:
    push = IpcSocket(context, zmq.PUSH, f"ipc://{tmp_path}/lonely", bind=True)
    try:
        assert push.send_nowait({"op": "stop"}) is False
        with anyio.move_on_after(0.1) as scope:
            await push.send({"op": "stop"})  # waits for a peer; cancellable
        assert scope.cancelled_caught
    finally:
        push.close()
    assert push.send_nowait({"op": "stop"}) is False


async def test_closing_wakes_a_waiting_receiver(context: zmq.Context[Any], tmp_path: Path) -> None:
    pull = IpcSocket(context, zmq.PULL, f"ipc://{tmp_path}/quiet", bind=True)
    outcome: list[str] = []

    async def receive() -> None:
        try:
            await pull.receive()
        except anyio.ClosedResourceError:
            outcome.append("closed")

    async with anyio.create_task_group() as group:
        group.start_soon(receive)
        await anyio.wait_all_tasks_blocked()
        pull.close()
        pull.close()  # idempotent
    assert outcome == ["closed"]
    with pytest.raises(anyio.ClosedResourceError):
        await pull.receive()
