"""The push protocol's edges, with a stand-in writer beside the served tests' real one.

The consumer's shards are real ZMQ REP sockets (``_consumer``); the write is a function the
test controls, so a write's outcome, its timing relative to a cancellation, and the age of
a reservation (an injected clock) are set exactly, with events, never sleeps.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
import zmq

from encdisagg import TransferError, TransferTimeoutError
from encdisagg.server._vllm._control import ControlChannel
from encdisagg.server._vllm._push import PushSpec, Shard, push_item
from encdisagg.transfer import MooncakeEngine

from ._consumer import fake_consumer

pytestmark = [pytest.mark.anyio, pytest.mark.mooncake]


def _spec(consumer: str) -> PushSpec:
    return PushSpec(consumer, "tid", "hash", 64, (4, 4), "float32")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Ageing(Clock):
    """A clock that moves 100 s each time it is read: every reservation is 200 s old by
    the time the push looks at it, whatever order the shards answered in."""

    def __call__(self) -> float:
        self.now += 100
        return self.now


async def test_stale_reservations_are_refreshed_before_the_write(
    shard_engines: list[MooncakeEngine],
) -> None:
    written: list[str] = []

    async def write(shard: Shard, count: int) -> None:
        written.append(shard.reservation_id)

    with fake_consumer(shard_engines, "write", "write") as consumer:
        async with ControlChannel(5) as channel:
            await push_item(
                channel, _spec(consumer.address), write, clock=Ageing(), refresh_after_s=150
            )
        first, second = consumer.shards
    assert first.ops == ["peers", "reserve_batch", "cancel", "reserve_batch", "complete_batch"]
    assert second.ops == ["reserve_batch", "cancel", "reserve_batch", "complete_batch"]
    assert first.requests[2] == {
        "op": "cancel",
        "transfer_id": "tid",
        "reservation_id": f"res-{first.port}-0",
        "refresh": True,
    }
    assert sorted(written) == sorted([f"res-{first.port}-1", f"res-{second.port}-1"])


async def test_a_write_of_unknown_outcome_keeps_its_reservation(
    shard_engines: list[MooncakeEngine],
) -> None:
    async def write(shard: Shard, count: int) -> None:
        if shard.address.endswith(str(consumer.shards[1].port)):
            raise TransferTimeoutError("the write may still land")

    with fake_consumer(shard_engines, "write", "write") as consumer:
        async with ControlChannel(5) as channel:
            with pytest.raises(TransferTimeoutError):
                await push_item(
                    channel, _spec(consumer.address), write, clock=Clock(), refresh_after_s=150
                )
        first, unknown = consumer.shards
    # The other shard is abandoned; the one a write may still touch is not handed back.
    assert first.ops == ["peers", "reserve_batch", "cancel"]
    assert first.requests[-1]["abandon"] is True
    assert unknown.ops == ["reserve_batch"]


async def test_cancelling_the_request_cancels_every_reservation(
    shard_engines: list[MooncakeEngine],
) -> None:
    writing = anyio.Event()

    async def write(shard: Shard, count: int) -> None:
        writing.set()
        await anyio.sleep_forever()

    with fake_consumer(shard_engines, "write", "write") as consumer:
        async with ControlChannel(5) as channel, anyio.create_task_group() as group:

            async def push() -> None:
                await push_item(
                    channel, _spec(consumer.address), write, clock=Clock(), refresh_after_s=150
                )

            group.start_soon(push)
            await writing.wait()
            group.cancel_scope.cancel()
        assert [shard.ops[-1] for shard in consumer.shards] == ["cancel", "cancel"]
        assert all(shard.requests[-1]["abandon"] for shard in consumer.shards)


async def test_a_silent_consumer_fails_within_the_control_bound() -> None:
    context: zmq.Context[Any] = zmq.Context()
    silent = context.socket(zmq.REP)  # bound, never answering
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with ControlChannel(0.2) as channel:
            with pytest.raises(TransferTimeoutError, match=r"no answer within 0\.2 s"):
                await push_item(
                    channel,
                    _spec(f"tcp://127.0.0.1:{port}"),
                    _never_called,
                    clock=Clock(),
                    refresh_after_s=150,
                )
    finally:
        silent.close(linger=0)
        context.term()


async def test_a_malformed_peers_answer_is_refused(shard_engines: list[MooncakeEngine]) -> None:
    with fake_consumer(shard_engines, "write") as consumer:
        consumer.shards[0].answer = lambda request, ports: {"ok": True, "result": {"ports": "x"}}  # type: ignore[method-assign]
        async with ControlChannel(5) as channel:
            with pytest.raises(TransferError, match="expected a list of ports"):
                await push_item(
                    channel,
                    _spec(consumer.address),
                    _never_called,
                    clock=Clock(),
                    refresh_after_s=1,
                )


async def _never_called(shard: Shard, count: int) -> None:
    raise AssertionError("no write was due")


class ScriptedChannel(ControlChannel):
    """A channel whose answers the test scripts: one shard never answers its reserve."""

    def __init__(self) -> None:
        super().__init__(1.0)
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def request(self, address: str, payload: dict[str, Any]) -> Any:
        await anyio.lowlevel.checkpoint()
        self.sent.append((address, payload))
        if payload["op"] == "peers":
            return {"ports": [1, 2]}
        if payload["op"] == "reserve_batch" and address.endswith(":2"):
            raise TransferTimeoutError(f"reserve_batch to {address}: no answer within 1.0 s")
        if payload["op"] == "reserve_batch":
            result = {
                "reservation_id": "r1",
                "dst_session": "s",
                "dst_ptr": 1,
                "nbytes": 64,
                "write": True,
                "ready": False,
                "cached": False,
            }
            return {"items": [{"ok": True, "result": result}]}
        return {"cancelled": True}


async def test_a_shard_that_did_not_answer_its_reserve_is_cancelled_too() -> None:
    channel = ScriptedChannel()
    with pytest.raises(TransferTimeoutError):
        await push_item(
            channel, _spec("tcp://h:1"), _never_called, clock=Clock(), refresh_after_s=150
        )
    cancels = sorted(
        (address, payload["reservation_id"])
        for address, payload in channel.sent
        if payload["op"] == "cancel" and payload["abandon"] is True
    )
    # The shard that answered by its reservation; the silent one by the transfer alone.
    assert cancels == [("tcp://h:1", "r1"), ("tcp://h:2", "")]
