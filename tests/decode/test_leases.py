"""The async shell: KV leases whose exit waits for drained-acks (rule 15), both backends."""

from __future__ import annotations

import logging

import anyio
import pytest

from encdisagg import RequestNotActiveError, ServiceUnavailableError
from encdisagg.decode import (
    DecodeKVLeases,
    DrainAcks,
    KVLease,
    LeaseState,
    PageAllocator,
)

from ._fakes import watched_slots

pytestmark = pytest.mark.anyio


def make_leases(
    *, pages: int = 8, slots: int = 4, timeout: float = 30.0, **kwargs: object
) -> tuple[DecodeKVLeases, PageAllocator]:
    allocator = PageAllocator(pages)
    slot_allocator, _ = watched_slots(slots)
    leases = DecodeKVLeases(
        allocator,
        slots=slot_allocator,
        release_timeout_s=timeout,
        **kwargs,  # type: ignore[arg-type]
    )
    return leases, allocator


async def exposed_then_raise(leases: DecodeKVLeases, error: Exception, seen: list[KVLease]) -> None:
    """A request whose block fails mid-transfer (pages exposed, no abort sent yet)."""
    async with leases.lease("r", 8, num_pages=2, required_acks=1) as lease:
        seen.append(lease)
        lease.expose()
        raise error


async def test_pages_are_freed_only_after_every_rank_acked_its_generation() -> None:
    leases, pages = make_leases()
    seen: list[KVLease] = []

    async def request() -> None:
        async with leases.lease("r1", 5, num_pages=3, required_acks=2) as lease:
            lease.expose()
            assert lease.abort() is not None
            seen.append(lease)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await anyio.wait_all_tasks_blocked()
        (lease,) = seen
        generation = lease.generation
        assert generation is not None
        assert lease.state is LeaseState.RELEASING
        assert leases.draining == 1
        assert pages.available() == 5
        assert leases.ack(5, 0, generation)
        assert leases.ack(5, 0, generation)  # one rank twice counts once
        assert not leases.ack(5, 1, generation + 100)  # not this generation: dropped
        await anyio.wait_all_tasks_blocked()
        assert pages.available() == 5
        assert leases.ack(5, 1, generation)
    assert pages.available() == 8
    assert lease.state is LeaseState.RELEASED
    assert not lease.timed_out
    assert leases.slots is not None
    assert leases.slots.available() == 4
    assert 5 not in leases.drains.tracker
    assert (leases.active, leases.draining, leases.timeouts) == (0, 0, 0)


async def test_acks_already_in_release_at_once() -> None:
    leases, pages = make_leases()
    async with leases.lease("r", 1, num_pages=1, required_acks=1) as lease:
        lease.expose()
        generation = lease.abort()
        assert generation is not None
        assert lease.abort() == generation  # idempotent
        assert leases.ack(1, 0, generation)
    assert pages.available() == 8


async def test_completed_or_never_exposed_pages_are_freed_at_once() -> None:
    leases, pages = make_leases()
    async with leases.lease("done", 1, num_pages=2, required_acks=4) as lease:
        lease.expose()
        lease.complete()
        assert lease.abort() is None  # nothing in flight: nobody to tell
    assert pages.available() == 8
    async with leases.lease("unused", 2, num_pages=2, required_acks=4) as lease:
        assert lease.abort() is None
    assert pages.available() == 8
    assert leases.timeouts == 0


async def test_tasks_in_the_lease_scope_end_before_the_pages_are_freed() -> None:
    leases, pages = make_leases()
    release_writer = anyio.Event()
    log: list[str] = []

    async def writer(lease: KVLease) -> None:
        await release_writer.wait()
        log.append(f"writer done, {pages.available()} free")

    async def request() -> None:
        async with leases.lease("r", 1, num_pages=4, required_acks=1) as lease:
            lease.scope.start_soon(writer, lease)
        log.append(f"lease closed, {pages.available()} free")

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await anyio.wait_all_tasks_blocked()
        assert pages.available() == 4
        release_writer.set()
    assert log == ["writer done, 4 free", "lease closed, 8 free"]


async def test_cancelling_the_caller_does_not_shorten_the_drain_wait() -> None:
    leases, pages = make_leases()
    seen: list[KVLease] = []
    outcome: list[str] = []

    async def request(task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            async with leases.lease("r", 3, num_pages=2, required_acks=1) as lease:
                lease.expose()
                lease.abort()
                seen.append(lease)
                await anyio.sleep_forever()
        outcome.append(f"cancelled={scope.cancelled_caught}, free={pages.available()}")

    async with anyio.create_task_group() as tg:
        scope = await tg.start(request)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        scope.cancel()  # twice changes nothing
        await anyio.wait_all_tasks_blocked()
        assert pages.available() == 6
        assert seen[0].state is LeaseState.RELEASING
        generation = seen[0].generation
        assert generation is not None
        leases.ack(3, 0, generation)
    assert outcome == ["cancelled=True, free=8"]


async def test_exit_mid_transfer_sends_the_abort_and_counts_an_ack_that_beats_it() -> None:
    sent: list[tuple[int, int | None]] = []

    async def send_abort(lease: KVLease) -> None:
        sent.append((lease.room, lease.generation))
        # The prefill rank answers before the send even returns.
        assert lease.generation is not None
        assert leases.ack(lease.room, 0, lease.generation)
        await anyio.lowlevel.checkpoint()

    leases, pages = make_leases(send_abort=send_abort)
    seen: list[KVLease] = []
    with pytest.raises(ValueError, match="client went away"):
        await exposed_then_raise(leases, ValueError("client went away"), seen)
    (lease,) = seen
    assert len(sent) == 1
    assert sent[0][0] == 8
    assert sent[0][1] == lease.generation
    assert pages.available() == 8
    assert not lease.timed_out


async def test_no_pages_or_no_slot_is_service_unavailable_and_leaks_nothing() -> None:
    leases, pages = make_leases(pages=2, slots=1)
    with pytest.raises(ServiceUnavailableError, match="needs 3 KV pages"):
        async with leases.lease("big", 1, num_pages=3, required_acks=1):
            pytest.fail("entered without pages")
    async with leases.lease("holder", 1, num_pages=1, required_acks=1):
        with pytest.raises(ServiceUnavailableError, match="metadata slot"):
            async with leases.lease("second", 2, num_pages=1, required_acks=1):
                pytest.fail("entered without a slot")
        assert pages.available() == 1
    assert pages.available() == 2
    assert leases.active == 0


async def test_state_changes_after_the_end_are_refused() -> None:
    leases, _ = make_leases()
    async with leases.lease("r", 1, num_pages=1, required_acks=1) as lease:
        lease.expose()
        lease.expose()
        lease.complete()
        with pytest.raises(RequestNotActiveError, match="complete"):
            lease.expose()
    with pytest.raises(RequestNotActiveError, match="released"):
        lease.abort()
    with pytest.raises(RequestNotActiveError, match="released"):
        lease.complete()


async def test_drain_acks_wait_wakes_only_its_generation() -> None:
    drains = DrainAcks()
    first = drains.arm(4)
    woke: list[str] = []

    async def waiter() -> None:
        await drains.wait_drained(4, first, 1)
        woke.append("first")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert drains.waiting(4, first) == 1
        assert not drains.ack(4, 0, first + 1)
        await anyio.wait_all_tasks_blocked()
        assert woke == []
        assert drains.ack(4, 0, first)
    assert woke == ["first"]
    assert drains.waiting(4, first) == 0


@pytest.mark.virtual_time
async def test_no_acks_frees_the_pages_at_the_timeout(caplog: pytest.LogCaptureFixture) -> None:
    leases, pages = make_leases(timeout=30.0)
    start = anyio.current_time()
    with caplog.at_level(logging.WARNING, logger="encdisagg.decode"):
        async with leases.lease("r", 9, num_pages=2, required_acks=2) as lease:
            lease.expose()
            generation = lease.abort()
            assert generation is not None
            leases.ack(9, 0, generation)  # one of two ranks never answers
    assert anyio.current_time() - start == pytest.approx(30.0)
    assert lease.timed_out
    assert leases.timeouts == 1
    assert pages.available() == 8
    assert "late write could still land" in caplog.text
    # A late ack after the release is dropped.
    assert not leases.ack(9, 1, generation)


@pytest.mark.virtual_time
async def test_timeout_counts_from_the_abort() -> None:
    leases, _ = make_leases(timeout=30.0)
    start = anyio.current_time()
    async with leases.lease("r", 9, num_pages=2, required_acks=1) as lease:
        lease.expose()
        lease.abort()
        await anyio.sleep(20)
    assert anyio.current_time() - start == pytest.approx(30.0)


@pytest.mark.virtual_time
async def test_exposed_pages_without_an_abort_sender_are_held_for_the_timeout() -> None:
    leases, pages = make_leases(timeout=12.5)
    start = anyio.current_time()
    seen: list[KVLease] = []
    with pytest.raises(KeyError, match="prefill peer died"):
        await exposed_then_raise(leases, KeyError("prefill peer died"), seen)
    (lease,) = seen
    assert anyio.current_time() - start == pytest.approx(12.5)
    assert lease.timed_out
    assert pages.available() == 8


@pytest.mark.virtual_time
async def test_a_late_ack_of_an_earlier_lifetime_does_not_release_a_reused_room() -> None:
    leases, pages = make_leases(timeout=30.0)
    old_generations: list[int] = []

    async def first() -> None:
        async with leases.lease("a", 77, num_pages=2, required_acks=1) as lease:
            lease.expose()
            generation = lease.abort()
            assert generation is not None
            old_generations.append(generation)

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
    # a timed out. b reuses room 77, is aborted, and a's rank acks late.
    start = anyio.current_time()
    async with anyio.create_task_group() as tg:

        async def second() -> None:
            async with leases.lease("b", 77, num_pages=2, required_acks=1) as lease:
                lease.expose()
                lease.abort()
            assert anyio.current_time() - start == pytest.approx(30.0)

        tg.start_soon(second)
        await anyio.wait_all_tasks_blocked()
        assert not leases.ack(77, 0, old_generations[0])
    assert leases.timeouts == 2
    assert pages.available() == 8


async def test_a_lone_error_from_the_block_keeps_its_cause_and_context() -> None:
    leases, pages = make_leases()

    async def fail_in_the_block() -> None:
        async with leases.lease("r", 8, num_pages=2, required_acks=1):
            try:
                raise OSError("the cause")
            except OSError as cause:
                raise ValueError("the transfer broke") from cause

    with pytest.raises(ValueError, match="the transfer broke") as caught:
        await fail_in_the_block()
    assert isinstance(caught.value.__cause__, OSError)
    # The lease's task group is not attached to the error as its context.
    assert not isinstance(caught.value.__context__, BaseExceptionGroup)
    assert pages.available() == 8
