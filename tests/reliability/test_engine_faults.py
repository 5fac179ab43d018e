"""Faults below the Encoder: a failing engine, a ZMQ receiver that disappears, a Mooncake peer
that is killed.

Every call ends with success or a clear error (``TransferError``) within its bound, nothing
leaks (``stats()``, the recording engine's regions and violations), and the Encoder keeps
serving once the fault is gone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import IO

import anyio
import anyio.to_thread
import pytest

from encdisagg import (
    Encoder,
    EncodeRequest,
    MooncakeDestination,
    TransferError,
    ZmqDestination,
)
from encdisagg.models import NullVisionModel
from encdisagg.transfer import ZmqReceiver

from ..encoder.fakes import HIDDEN, RecordingEngine, ScriptedModel
from ._support import fast_config, sized, wait_idle

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]


def assert_idle(encoder: Encoder) -> None:
    stats = encoder.stats()
    assert stats.live_requests == 0, stats
    assert stats.staged_bytes == 0, stats
    assert stats.inflight_transfers == 0, stats
    # While open, only the staging arena (if its registration succeeded) stays registered.
    assert stats.registered_regions <= (1 if encoder.is_open else 0), stats


async def test_engine_failures_end_clearly_and_leak_nothing() -> None:
    engine = RecordingEngine(
        rng=random.Random(11), register_failure_rate=0.3, write_failure_rate=0.3
    )
    encoder = Encoder(fast_config(max_batch_size=4), model=ScriptedModel(), engine=engine)
    rng = random.Random(5)
    outcomes: Counter[str] = Counter()
    limiter = anyio.CapacityLimiter(64)  # callers in flight at once

    async with encoder:

        async def one(index: int) -> None:
            rid = f"faulty-{index}"
            tokens = rng.randint(1, 8)
            buffer = engine.add_remote_buffer(tokens * HIDDEN * 2)
            destination = MooncakeDestination(engine.session_id, buffer.data_ptr(), "rx:1")
            async with limiter:
                with anyio.fail_after(5):  # far above any healthy call
                    try:
                        await encoder.encode(EncodeRequest(rid, [tokens]))
                        await encoder.send(rid, destination)
                        outcomes["delivered"] += 1
                    except TransferError:
                        outcomes["TransferError"] += 1

        async with anyio.create_task_group() as group:
            for index in range(sized(200, 5000)):
                group.start_soon(one, index)
        await wait_idle(encoder)
        assert_idle(encoder)
        assert engine.violations == []
        # Nothing but the staging arena (if it registered) is held while open.
        assert len(engine.regions) == encoder.stats().registered_regions
        assert outcomes["delivered"] > 0
        assert outcomes["TransferError"] > 0

        # The fault is gone: everything goes through again.
        engine.register_failure_rate = engine.write_failure_rate = 0.0
        for index in range(20):
            buffer = engine.add_remote_buffer(4 * HIDDEN * 2)
            await encoder.encode(EncodeRequest(f"healthy-{index}", [4]))
            await encoder.send(
                f"healthy-{index}", MooncakeDestination(engine.session_id, buffer.data_ptr(), "rx")
            )
        assert_idle(encoder)
    assert engine.regions == {}
    assert engine.violations == []


@pytest.mark.virtual_time
async def test_failed_deregistrations_are_retried_until_they_succeed() -> None:
    engine = RecordingEngine(deregister_failures=5)
    # Each request registers its own memory, so the failures hit those registrations.
    encoder = Encoder(fast_config(staging_arena_mb=0), model=ScriptedModel(), engine=engine)
    async with encoder:
        for index in range(5):
            buffer = engine.add_remote_buffer(4 * HIDDEN * 2)
            await encoder.encode(EncodeRequest(f"r{index}", [4]))
            await encoder.send(
                f"r{index}", MooncakeDestination(engine.session_id, buffer.data_ptr(), "rx")
            )
        # Their regions stay registered (and their bytes counted) until a retry succeeds.
        assert encoder.stats().registered_regions > 0
        with anyio.fail_after(120):
            while encoder.stats().registered_regions:
                await anyio.sleep(0.5)
        assert_idle(encoder)
    assert engine.violations == []
    assert engine.regions == {}


async def test_zmq_receiver_that_disappears_fails_sends_within_their_bound() -> None:
    # 4 MiB embeddings, 96 MiB in all: more than the loopback socket buffers take (the
    # receive buffer grows to 32 MiB here), so however fast the first ones leave, some are
    # still held by ZMQ when the receiver goes away, and those sends fail.
    model = NullVisionModel(hidden_size=64, tokens_per_item=32768)
    encoder = Encoder(fast_config(zmq_send_timeout_s=2.0), model=model)
    requests = sized(24, 100)
    outcomes: Counter[str] = Counter()
    async with encoder:
        for index in range(requests):
            await encoder.encode(EncodeRequest(f"z{index}", [f"z{index}"]))
        receiver = ZmqReceiver(max_queued_messages=2)
        async with receiver:
            destination = ZmqDestination(receiver.url)

            async def send(index: int) -> None:
                # The bound: zmq_send_timeout_s, plus the shielded wait for ZMQ to let go of
                # the payload (release_timeout_s, 5 s), plus slack.
                with anyio.fail_after(10):
                    try:
                        await encoder.send(f"z{index}", destination)
                        outcomes["sent"] += 1
                    except TransferError:
                        outcomes["TransferError"] += 1

            async with anyio.create_task_group() as group:
                for index in range(requests):
                    group.start_soon(send, index)
                for _ in range(3):
                    with anyio.fail_after(5):
                        await receiver.receive()
                await receiver.aclose()  # gone, with sends still queued
        assert outcomes["sent"] >= 3
        assert outcomes["TransferError"] > 0, outcomes
        assert outcomes.total() == requests
        await wait_idle(encoder)
        assert_idle(encoder)

        # A receiver that stays: sends go through again.
        async with ZmqReceiver() as receiver:
            for index in range(5):
                rid = f"after-{index}"
                await encoder.encode(EncodeRequest(rid, [rid]))
                await encoder.send(rid, ZmqDestination(receiver.url))
                with anyio.fail_after(5):
                    assert (await receiver.receive()).header.req_id == rid
        assert_idle(encoder)


@pytest.mark.mooncake
async def test_mooncake_peer_killed_mid_run() -> None:
    pytest.importorskip("mooncake.engine")
    nbytes = 8 * 2048 * 64 * 2  # eight 256 KiB slots

    def start_peer(errors: IO[bytes]) -> tuple[subprocess.Popen[str], dict[str, object]]:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.transfer._mooncake_peer", str(nbytes)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,  # a file, not a pipe: Mooncake logs enough to fill one
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert process.stdout is not None
        # The readiness handshake: the peer announces itself once its buffer is registered.
        line = process.stdout.readline()
        if not line:
            process.wait(30)
            errors.seek(0)
            raise AssertionError(f"the Mooncake peer did not start:\n{errors.read()[-2000:]!r}")
        return process, json.loads(line)

    def stop_peer(process: subprocess.Popen[str]) -> None:
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        process.wait(30)

    config = fast_config(transfer="mooncake", max_batch_size=4)
    model = NullVisionModel(hidden_size=64, tokens_per_item=2048)
    requests = sized(16, 400)
    kill_after = requests // 4  # requests finished (all delivered) before the kill
    # Each request ends in one of three phases: "alive" (finished before the kill was
    # decided: it must be delivered), "dying" (running while the peer is killed: either
    # outcome), "dead" (started once the peer was reaped: it must fail).
    outcomes: dict[str, Counter[str]] = {"alive": Counter(), "dying": Counter(), "dead": Counter()}
    with tempfile.TemporaryFile() as errors:
        async with Encoder(config, model=model) as encoder:
            process, peer = await anyio.to_thread.run_sync(start_peer, errors)
            try:
                session, base = str(peer["session_id"]), int(str(peer["ptr"]))
                kill_now, dead = anyio.Event(), anyio.Event()
                finished = 0
                limiter = anyio.CapacityLimiter(4)  # requests in flight at once

                async def one(index: int) -> None:
                    nonlocal finished
                    rid = f"mc-{index}"
                    slot = base + (index % 8) * (nbytes // 8)
                    destination = MooncakeDestination(session, slot, "peer:1")
                    async with limiter:
                        # The kill is decided by how many requests finished, not by which
                        # (Trio starts tasks in a shuffled order); one that starts after it
                        # was decided waits until the peer is reaped, so it cannot slip
                        # through while the killed process is still being torn down.
                        started_after_kill = kill_now.is_set()
                        if started_after_kill:
                            await dead.wait()
                        # Far above the Encoder's own bounds (request_timeout_s 5 s,
                        # send_timeout_s 10 s, cleanup 2 s): the Encoder must end the call
                        # itself, with success or TransferError.
                        with anyio.fail_after(60):
                            try:
                                await encoder.encode(EncodeRequest(rid, [rid]))
                                await encoder.send(rid, destination)
                                outcome = "delivered"
                            except TransferError:
                                outcome = "TransferError"
                        phase = (
                            "dead"
                            if started_after_kill
                            else "dying"
                            if kill_now.is_set()
                            else "alive"
                        )
                        outcomes[phase][outcome] += 1
                        finished += 1
                        if finished == kill_after:
                            kill_now.set()  # before the slot is released: the next one sees it

                async def kill() -> None:
                    await kill_now.wait()
                    os.kill(process.pid, signal.SIGKILL)
                    await anyio.to_thread.run_sync(process.wait, 60)
                    dead.set()

                async with anyio.create_task_group() as group:
                    group.start_soon(kill)
                    for index in range(requests):
                        group.start_soon(one, index)
            finally:
                process.kill()
                await anyio.to_thread.run_sync(stop_peer, process)
            assert outcomes["alive"] == Counter(delivered=kill_after), outcomes
            # At most four were running when the kill was decided; all later ones started
            # against a dead peer.
            assert outcomes["dead"]["TransferError"] >= requests - kill_after - 4, outcomes
            assert outcomes["dead"]["delivered"] == 0, outcomes
            assert sum(c.total() for c in outcomes.values()) == requests, outcomes
            await wait_idle(encoder)
            assert_idle(encoder)

            # A new peer: deliveries work again.
            process, peer = await anyio.to_thread.run_sync(start_peer, errors)
            try:
                for index in range(3):
                    rid = f"after-{index}"
                    await encoder.encode(EncodeRequest(rid, [rid]))
                    await encoder.send(
                        rid,
                        MooncakeDestination(str(peer["session_id"]), int(str(peer["ptr"])), "p"),
                    )
            finally:
                await anyio.to_thread.run_sync(stop_peer, process)
            assert_idle(encoder)
