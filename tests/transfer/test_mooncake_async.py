"""MooncakeEngine.write_async: writes awaited on the event loop, over real Mooncake TCP
(two engines in this process) and against a scripted engine for the answers TCP never gives.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from typing import Any

import anyio
import anyio.from_thread
import pytest
import torch

from encdisagg import TransferError, TransferTimeoutError
from encdisagg.nurseries import ThreadSafeEvent, run_thread_to_completion
from encdisagg.transfer import Hold, MooncakeEngine
from encdisagg.transfer._mooncake import _engine as _mooncake, _waiter as _mooncake_waiter

pytestmark = [pytest.mark.anyio, pytest.mark.mooncake]

MIB = 1 << 20


class RecordingMooncake:
    """Wraps a real pybind engine: records each submit and each status answer, and runs a
    hook right after a submit returned (on the caller's thread)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.submitted: list[int] = []
        self.answers: dict[int, list[int]] = {}
        self.after_submit: Callable[[], None] | None = None

    def transfer_submit_write(self, target: str, local: int, remote: int, nbytes: int) -> int:
        batch = int(self._real.transfer_submit_write(target, local, remote, nbytes))
        self.submitted.append(batch)
        if self.after_submit is not None:
            self.after_submit()
        return batch

    def transfer_check_status(self, batch: int) -> int:
        rc = int(self._real.transfer_check_status(batch))
        self.answers.setdefault(batch, []).append(rc)
        return rc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def mooncake_pair() -> Iterator[tuple[MooncakeEngine, MooncakeEngine]]:
    """A pair of this module's own, so the first test's first write is the sender's first
    write to that receiver (the path under test). On the session's shared pair, whose
    session another module opened, that write failed (rc=-1) against memory the receiver
    registered after the session opened."""
    with anyio.from_thread.start_blocking_portal() as portal, ExitStack() as stack:
        first = stack.enter_context(portal.wrap_async_context_manager(MooncakeEngine()))
        second = stack.enter_context(portal.wrap_async_context_manager(MooncakeEngine()))
        yield first, second


@pytest.fixture
def pair(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[MooncakeEngine, RecordingMooncake, torch.Tensor, torch.Tensor]]:
    """The shared pair, the sender's Mooncake recorded, a registered 16 MiB source on the
    sender and a registered 16 MiB target on the receiver."""
    sender, receiver = mooncake_pair
    recording = RecordingMooncake(sender._engine)
    monkeypatch.setattr(sender, "_engine", recording)
    source = torch.randint(0, 256, (16 * MIB,), dtype=torch.uint8)
    target = torch.zeros(16 * MIB, dtype=torch.uint8)
    sender.register(source.data_ptr(), source.numel())
    receiver.register(target.data_ptr(), target.numel())
    try:
        yield sender, recording, source, target
    finally:
        sender.deregister(source.data_ptr())
        receiver.deregister(target.data_ptr())


async def test_writes_land_whole_first_through_a_thread_then_from_the_loop(
    pair: tuple[MooncakeEngine, RecordingMooncake, torch.Tensor, torch.Tensor],
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine],
    thread_calls: list[Callable[..., Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sender, recording, source, target = pair
    session = mooncake_pair[1].session_id
    sender._connected.discard(session)
    src, dst = source.data_ptr(), target.data_ptr()

    # The first write to a session opens it (a handshake, inside the submit): the submit runs
    # in a worker thread, and the write is then waited for as any other.
    await sender.write_async(session, src, dst, MIB)
    assert len(recording.submitted) == 1
    assert sender._submit in thread_calls
    assert recording.answers[recording.submitted[0]][-1] == _mooncake_waiter.DONE
    recording.submitted.clear()
    thread_calls.clear()

    # Then 1 MiB is submitted on the loop, 8 MiB (over the bound set here) from a worker
    # thread; both are waited for until Mooncake said done, and no worker thread waits.
    monkeypatch.setattr(sender, "_submit_on_loop_max_bytes", 4 * MIB)
    await sender.write_async(session, src + MIB, dst + MIB, MIB)
    assert thread_calls == []
    await sender.write_async(session, src + 2 * MIB, dst + 2 * MIB, 8 * MIB)
    assert len(thread_calls) == 1
    assert len(recording.submitted) == 2
    for batch in recording.submitted:
        assert recording.answers[batch][-1] == _mooncake_waiter.DONE
    assert torch.equal(target[: 10 * MIB], source[: 10 * MIB])


async def test_concurrent_writes_each_wait_for_their_own(
    pair: tuple[MooncakeEngine, RecordingMooncake, torch.Tensor, torch.Tensor],
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine],
) -> None:
    sender, recording, source, target = pair
    session = mooncake_pair[1].session_id
    await sender.write_async(session, source.data_ptr(), target.data_ptr(), 4096)
    recording.submitted.clear()
    async with anyio.create_task_group() as group:
        for index in range(8):
            offset = index * MIB
            group.start_soon(
                sender.write_async,
                session,
                source.data_ptr() + offset,
                target.data_ptr() + offset,
                MIB,
            )
    assert len(recording.submitted) == 8
    assert all(recording.answers[b][-1] == _mooncake_waiter.DONE for b in recording.submitted)
    assert torch.equal(target[: 8 * MIB], source[: 8 * MIB])


@pytest.mark.parametrize("nbytes", [MIB, 8 * MIB], ids=["submitted-on-loop", "from-thread"])
async def test_a_cancelled_write_returns_only_once_mooncake_said_it_ended(
    pair: tuple[MooncakeEngine, RecordingMooncake, torch.Tensor, torch.Tensor],
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine],
    nbytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sender, recording, source, target = pair
    session = mooncake_pair[1].session_id
    monkeypatch.setattr(sender, "_submit_on_loop_max_bytes", 4 * MIB)
    await sender.write_async(session, source.data_ptr(), target.data_ptr(), 4096)
    recording.submitted.clear()
    returned: list[bool] = []

    async def write(scope: anyio.CancelScope) -> None:
        with scope:
            await sender.write_async(session, source.data_ptr(), target.data_ptr(), nbytes)
            returned.append(True)

    async with anyio.create_task_group() as group:
        scope = anyio.CancelScope()

        def cancel_twice() -> None:
            scope.cancel()
            scope.cancel()

        def after_submit() -> None:
            # Right after the submit (Mooncake owns the memory now), twice over; an 8 MiB
            # write is submitted from a worker thread.
            if threading.current_thread() is loop_thread:
                cancel_twice()
            else:
                anyio.from_thread.run_sync(cancel_twice)

        loop_thread = threading.current_thread()
        recording.after_submit = after_submit
        group.start_soon(write, scope)
    assert returned == []  # the cancellation was delivered...
    assert scope.cancelled_caught
    (batch,) = recording.submitted
    # ...but only after Mooncake reported the write done.
    assert recording.answers[batch][-1] == _mooncake_waiter.DONE
    assert torch.equal(target[:nbytes], source[:nbytes])


async def test_a_failed_write_raises_and_reopens_the_session_next_time(
    pair: tuple[MooncakeEngine, RecordingMooncake, torch.Tensor, torch.Tensor],
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine],
) -> None:
    sender, _, source, target = pair
    session = mooncake_pair[1].session_id
    await sender.write_async(session, source.data_ptr(), target.data_ptr(), 4096)
    assert session in sender._connected
    # Past the end of the receiver's registered buffer: the receiver refuses it.
    with pytest.raises(TransferError, match=r"write to .* failed \((rc=-1|batch id \d+)\)"):
        await sender.write_async(session, source.data_ptr(), target.data_ptr() + 16 * MIB, 4096)
    assert session not in sender._connected
    with pytest.raises(TransferError, match="not inside a registered region"):
        await sender.write_async(session, 0x1000, target.data_ptr(), 4096)


class ScriptedMooncake:
    """A stand-in engine whose submits and status answers are scripted."""

    def __init__(
        self, batch: int, statuses: list[int], *, stall_s: dict[int, float] | None = None
    ) -> None:
        self.batch = batch
        self.statuses = statuses
        self.polled: list[int] = []
        #: The thread of each status call, in order.
        self.pollers: list[threading.Thread] = []
        #: How long the status call of each index blocks its caller.
        self.stall_s = stall_s or {}

    def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 15000

    def register_memory(self, ptr: int, nbytes: int) -> int:
        return 0

    def unregister_memory(self, ptr: int) -> int:
        return 0

    def transfer_submit_write(self, target: str, local: int, remote: int, nbytes: int) -> int:
        return self.batch

    def transfer_check_status(self, batch: int) -> int:
        stall = self.stall_s.get(len(self.polled))
        self.polled.append(batch)
        self.pollers.append(threading.current_thread())
        if stall is not None:
            time.sleep(stall)
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


async def _scripted_write(
    monkeypatch: pytest.MonkeyPatch,
    fake: ScriptedMooncake,
    *,
    poll_on_loop_s: float = _mooncake.POLL_ON_LOOP_S,
) -> None:
    monkeypatch.setattr(_mooncake, "_create_mooncake", lambda: fake)
    async with MooncakeEngine(poll_on_loop_s=poll_on_loop_s) as engine:
        engine.register(0x1000, 4096)
        engine._connected.add("peer:1")
        try:
            await engine.write_async("peer:1", 0x1000, 0x9000, 4096)
        finally:
            engine.deregister(0x1000)


@pytest.mark.parametrize("batch", [0, (1 << 64) - 1])
async def test_a_refused_submit_raises_without_polling(
    monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    fake = ScriptedMooncake(batch, [_mooncake_waiter.DONE])
    with pytest.raises(TransferError, match=rf"failed \(batch id {batch}\)") as raised:
        await _scripted_write(monkeypatch, fake)
    assert type(raised.value) is TransferError
    assert fake.polled == []


@pytest.mark.parametrize(
    ("poll_on_loop_s", "on_loop"), [(_mooncake.POLL_ON_LOOP_S, 4), (0.0, 1)], ids=["loop", "thread"]
)
async def test_a_write_polled_until_done(
    monkeypatch: pytest.MonkeyPatch, poll_on_loop_s: float, on_loop: int
) -> None:
    # Polled on the loop (every check there), or, with no loop polling, by the completion
    # thread after the one check right after the submit.
    fake = ScriptedMooncake(0x55, [0, 0, 0, _mooncake_waiter.DONE])
    loop_thread = threading.current_thread()
    await _scripted_write(monkeypatch, fake, poll_on_loop_s=poll_on_loop_s)
    assert fake.polled == [0x55] * 4
    assert [t is loop_thread for t in fake.pollers] == [True] * on_loop + [False] * (4 - on_loop)


async def test_a_write_still_running_after_the_loop_polling_moves_to_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The second check (the first loop poll) stalls past the loop-polling window: the
    # checks after it are the completion thread's.
    fake = ScriptedMooncake(0x55, [0, 0, 0, _mooncake_waiter.DONE], stall_s={1: 0.4})
    loop_thread = threading.current_thread()
    await _scripted_write(monkeypatch, fake, poll_on_loop_s=0.2)
    assert [t is loop_thread for t in fake.pollers] == [True, True, False, False]


def test_poll_on_loop_s_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="poll_on_loop_s"):
        MooncakeEngine(poll_on_loop_s=-1.0)


async def test_a_failed_write_is_a_plain_failure_and_holds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = ScriptedMooncake(0x55, [0, _mooncake_waiter.FAILED])
    with pytest.raises(TransferError, match=r"failed \(rc=-1\)") as raised:
        await _scripted_write(monkeypatch, fake)
    assert type(raised.value) is TransferError
    assert raised.value.status == 502


@pytest.mark.parametrize("blocking", [False, True], ids=["write_async", "write"])
async def test_a_mooncake_timeout_holds_the_memory_until_mooncake_reports_the_end(
    monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    # TIMED_OUT is not a failure: the batch is not freed and its slices may still read the
    # memory. The engine keeps checking it; the hold settles once Mooncake says it ended.
    fake = ScriptedMooncake(0x55, [0, _mooncake_waiter.TIMED_OUT, 0, _mooncake_waiter.DONE])
    monkeypatch.setattr(_mooncake, "_create_mooncake", lambda: fake)
    async with MooncakeEngine() as engine:
        engine.register(0x1000, 4096)
        engine._connected.add("peer:1")
        args = ("peer:1", 0x1000, 0x9000, 4096)
        write = (
            partial(run_thread_to_completion, engine.write, *args)
            if blocking
            else partial(engine.write_async, *args)
        )
        with pytest.raises(TransferTimeoutError, match=r"timed out \(rc=-2\)") as raised:
            await write()
        assert raised.value.status == 504
        hold = raised.value.hold
        assert isinstance(hold, Hold)
        assert hold.nbytes == 4096
        assert engine.unsettled == 1
        settled = ThreadSafeEvent()
        hold.on_settled(lambda _: settled.set_from_thread())
        with anyio.fail_after(10):
            await settled.wait()
        assert hold.reason == "Mooncake reported the write done"
        assert engine.unsettled == 0
        # Not the session's open state any more: the next write opens it afresh.
        assert "peer:1" not in engine._connected
        engine.deregister(0x1000)


async def test_a_write_that_never_ends_is_held_until_the_engine_was_destroyed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mooncake's synchronous write gives up after its bound and answers -1, like a
    # failure: submitted and checked instead, the outcome stays unknown, and the region it
    # reads from stays registered (and its memory alive) until the engine is gone.
    fake = ScriptedMooncake(0x55, [0])
    monkeypatch.setattr(_mooncake, "_create_mooncake", lambda: fake)
    monkeypatch.setattr(_mooncake, "_mooncake_transfer_timeout_s", lambda: 0.05)
    unregistered: list[int] = []
    monkeypatch.setattr(fake, "unregister_memory", lambda ptr: unregistered.append(ptr) or 0)
    async with MooncakeEngine() as engine:
        engine.register(0x1000, 4096)
        engine.register(0x4000, 4096)
        with pytest.raises(TransferTimeoutError, match="did not end in time") as raised:
            await run_thread_to_completion(engine.write, "peer:1", 0x1000, 0x9000, 4096)
        hold = raised.value.hold
        assert isinstance(hold, Hold)
        assert not hold.settled
        memory = torch.zeros(16)
        engine.keep_until_closed(memory)
        kept = weakref.ref(memory)
        del memory
    assert hold.reason == "the Mooncake engine was destroyed"
    # The held region was not deregistered under the write; the other one was.
    assert unregistered == [0x4000]
    gc.collect()
    assert kept() is None
