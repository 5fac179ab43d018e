"""The transfer contract's types: Hold, HeldLedger, MemoryRegistration, leaving memory to an
engine. The real engines and the Encoder have tests of their own; here each type alone."""

from __future__ import annotations

import gc
import threading
import weakref

import anyio
import pytest
import torch

from encdisagg import TransferError
from encdisagg.nurseries import ThreadSafeEvent
from encdisagg.transfer import (
    HeldLedger,
    Hold,
    HoldPolicy,
    LoopbackEngine,
    MemoryRegistration,
    MemoryRegistrationState,
    leave_with_engine,
)


class _Engine:
    """Records registrations; a test makes deregistrations fail or block."""

    def __init__(self) -> None:
        self.session_id = "test:1"
        self.live: set[int] = set()
        self.deregister_failures = 0
        self.register_gate: threading.Event | None = None
        self.register_entered = threading.Event()

    def register(self, ptr: int, nbytes: int) -> None:
        self.register_entered.set()
        if self.register_gate is not None:
            self.register_gate.wait(10)
        self.live.add(ptr)

    def deregister(self, ptr: int) -> None:
        if self.deregister_failures:
            self.deregister_failures -= 1
            raise TransferError("injected deregister failure")
        self.live.remove(ptr)

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        raise AssertionError("not used")


async def _close_in_a_task(registration: MemoryRegistration, timeout_s: float) -> bool:
    """``registration.close``, in a task of its own: the frames its bound cut short go with
    the task, so they do not keep the memory alive past the test's checks."""
    closed: list[bool] = []

    async def close() -> None:
        closed.append(await registration.close(timeout_s=timeout_s))

    async with anyio.create_task_group() as group:
        group.start_soon(close)
    return closed[0]


def test_a_hold_settles_once_and_lets_go_of_what_it_kept_after_telling_its_owners() -> None:
    hold = Hold("a test region", 64)
    memory = torch.zeros(16)
    kept = weakref.ref(memory)
    hold.keep(memory)
    del memory
    gc.collect()
    assert kept() is not None
    told: list[tuple[str | None, bool]] = []
    hold.on_settled(lambda h: told.append((h.reason, kept() is not None)))
    assert hold.settle("the write ended")
    assert not hold.settle("again")
    assert told == [("the write ended", True)]  # the owner was told before the memory went
    gc.collect()
    assert kept() is None
    # Late callbacks run at once; late keeps keep nothing.
    hold.on_settled(lambda h: told.append((h.reason, False)))
    assert told[-1] == ("the write ended", False)
    late = torch.zeros(4)
    late_ref = weakref.ref(late)
    hold.keep(late)
    del late
    gc.collect()
    assert late_ref() is None


def test_a_callback_that_raises_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hold = Hold("a test region")
    told: list[str] = []

    def broken(_: Hold) -> None:
        raise RuntimeError("owner bug")

    hold.on_settled(broken)
    hold.on_settled(lambda _: told.append("second"))
    hold.settle("done")
    assert told == ["second"]
    assert "owner bug" in caplog.text


def test_holds_settle_from_other_threads() -> None:
    holds = [Hold(f"region {i}", 1) for i in range(200)]
    ledger = HeldLedger("test")
    for hold in holds:
        ledger.add(hold)
    assert (len(ledger), ledger.held_bytes, ledger.taken) == (200, 200, 200)
    threads = [
        threading.Thread(target=lambda h=hold: [h.settle("done") for _ in range(3)])
        for hold in holds
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (len(ledger), ledger.held_bytes, ledger.taken) == (0, 0, 200)


def test_the_ledger_counts_a_hold_once_and_logs_it_once(caplog: pytest.LogCaptureFixture) -> None:
    ledger = HeldLedger("receiver")
    hold = Hold("pages 3+2", 8192)
    ledger.add(hold)
    ledger.add(hold)
    assert ledger.held_bytes == 8192
    assert ledger.holds() == (hold,)
    assert caplog.text.count("pages 3+2 is held") == 1
    hold.settle("confirmed")
    ledger.add(hold)  # settled already: nothing to count
    assert ledger.held_bytes == 0


def test_a_policy_parses_from_its_name_and_names_the_field() -> None:
    assert HoldPolicy.parse("retire") is HoldPolicy.RETIRE
    assert HoldPolicy.parse(HoldPolicy.REUSE) is HoldPolicy.REUSE
    with pytest.raises(ValueError, match="on_timeout must be one of 'retire', 'reuse'"):
        HoldPolicy.parse("forget", field="on_timeout")


@pytest.mark.anyio
async def test_a_registration_is_not_dropped_while_held_and_goes_once_its_holds_settle() -> None:
    engine = _Engine()
    buffer = torch.zeros(4096, dtype=torch.uint8)
    gone: list[str] = []
    registration = MemoryRegistration(
        engine,
        buffer.data_ptr(),
        4096,
        buffer,
        what="a test buffer",
        on_deregistered=lambda: gone.append("gone"),
    )
    await registration.open()
    assert registration.registered
    hold = Hold("a write from it", 1024)
    registration.hold(hold)
    assert registration.held
    assert not registration.deregister_sync()  # refused while held, the engine not called
    assert engine.live == {buffer.data_ptr()}
    settled = ThreadSafeEvent()

    async def settle_later() -> None:
        await anyio.sleep(0.05)
        await anyio.to_thread.run_sync(hold.settle, "the write ended")
        settled.set_from_thread()

    async with anyio.create_task_group() as group:
        group.start_soon(settle_later)
        assert await registration.close(timeout_s=10)
    await settled.wait()
    assert registration.state is MemoryRegistrationState.DEREGISTERED
    assert engine.live == set()
    assert gone == ["gone"]
    assert registration.keepalive is None
    assert await registration.close(timeout_s=1)  # once only: nothing more happens


@pytest.mark.anyio
async def test_a_failed_deregistration_is_retried_within_the_bound() -> None:
    engine = _Engine()
    engine.deregister_failures = 2
    buffer = torch.zeros(4096, dtype=torch.uint8)
    registration = MemoryRegistration(engine, buffer.data_ptr(), 4096, buffer, what="a buffer")
    await registration.open()
    assert await registration.close(timeout_s=10)
    assert engine.live == set()


@pytest.mark.anyio
async def test_past_its_bound_a_held_registration_is_left_alive_to_its_engine() -> None:
    fabric_engine = LoopbackEngine()
    buffer = torch.zeros(4096, dtype=torch.uint8)
    alive = weakref.ref(buffer)
    registration = MemoryRegistration(
        fabric_engine, buffer.data_ptr(), 4096, buffer, what="a held buffer"
    )
    await registration.open()
    registration.hold(Hold("a write that never ends"))
    del buffer
    assert not await _close_in_a_task(registration, 0.05)
    assert registration.state is MemoryRegistrationState.LEFT
    assert fabric_engine.registered_regions() == 1
    del registration
    gc.collect()
    assert alive() is not None
    fabric_engine.close()  # nothing can write through a closed engine: the memory may go
    gc.collect()
    assert alive() is None


@pytest.mark.anyio
async def test_a_cancelled_open_still_records_what_the_engine_registered() -> None:
    engine = _Engine()
    engine.register_gate = threading.Event()
    buffer = torch.zeros(4096, dtype=torch.uint8)
    registration = MemoryRegistration(engine, buffer.data_ptr(), 4096, buffer, what="a buffer")
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(registration.open)
            await anyio.to_thread.run_sync(engine.register_entered.wait)
            scope.cancel()
            engine.register_gate.set()
    assert scope.cancelled_caught
    assert registration.registered
    assert await registration.close(timeout_s=5)
    assert engine.live == set()


def test_memory_left_to_an_engine_that_cannot_say_when_it_closes_is_kept_for_good(
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory = torch.zeros(8)
    kept = weakref.ref(memory)
    leave_with_engine(_Engine(), memory, what="a test buffer")
    del memory
    gc.collect()
    assert kept() is not None
    assert "kept for the life of the process" in caplog.text
