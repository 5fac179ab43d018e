from __future__ import annotations

import math
from dataclasses import dataclass, field

import anyio
import pytest

from encdisagg.nurseries import (
    OwningScope,
    ReleaseFailedError,
    ScopeClosedError,
    ScopeState,
    open_owning_scope,
)

pytestmark = pytest.mark.anyio


@dataclass
class RecordingResource:
    """Records every use and the release, and flags use after release."""

    log: list[str] = field(default_factory=list)
    released: int = 0
    used_after_release: bool = False

    def use(self, what: str) -> None:
        if self.released:
            self.used_after_release = True
        self.log.append(what)


def recording_scope(
    resource: RecordingResource,
    *,
    fail_release: bool = False,
    hang_release: bool = False,
    cleanup_timeout: float = 10.0,
    deadline: float = math.inf,
) -> OwningScope[RecordingResource]:
    async def acquire() -> RecordingResource:
        resource.log.append("acquired")
        return resource

    async def release(r: RecordingResource) -> None:
        r.released += 1
        r.log.append("released")
        if hang_release:
            await anyio.sleep_forever()
        if fail_release:
            raise OSError("deregistration failed")

    return OwningScope(
        acquire,
        release,
        name="test scope",
        cleanup_timeout=cleanup_timeout,
        deadline=deadline,
    )


async def test_release_waits_for_every_child() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource)
    gates = [anyio.Event() for _ in range(3)]

    async def child(index: int) -> None:
        await gates[index].wait()
        resource.use(f"child {index} done")

    async with anyio.create_task_group() as owner:
        await owner.start(scope.run)
        assert scope.state is ScopeState.OPEN
        for index in range(3):
            scope.start_soon(child, index)
        scope.wind_down()
        for index in (2, 0, 1):
            await anyio.wait_all_tasks_blocked()
            # Wound down, but children still run: nothing may be released yet.
            assert resource.released == 0
            assert scope.state is ScopeState.WINDING_DOWN
            gates[index].set()
    assert resource.log == ["acquired", "child 2 done", "child 0 done", "child 1 done", "released"]
    assert resource.released == 1
    assert not resource.used_after_release
    assert scope.state is ScopeState.CLOSED


async def test_no_new_work_once_winding_down() -> None:
    scope = recording_scope(RecordingResource())
    async with anyio.create_task_group() as owner:
        await owner.start(scope.run)
        scope.wind_down()
        scope.wind_down()  # idempotent
        with pytest.raises(ScopeClosedError, match="winding_down"):
            scope.start_soon(anyio.sleep, 0)
        with pytest.raises(ScopeClosedError):
            await scope.call(anyio.sleep, 0)


async def test_cancel_lets_shielded_parts_finish_before_release() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource)
    in_transfer = anyio.Event()
    finish_transfer = anyio.Event()

    async def transfer() -> None:
        with anyio.CancelScope(shield=True):
            in_transfer.set()
            await finish_transfer.wait()
            resource.use("transfer finished")
        await anyio.sleep_forever()

    async with anyio.create_task_group() as owner:
        await owner.start(scope.run)
        scope.start_soon(transfer)
        await in_transfer.wait()
        scope.cancel()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert resource.released == 0
        finish_transfer.set()
    assert resource.log == ["acquired", "transfer finished", "released"]
    assert not scope.expired


async def test_failing_release_does_not_hide_the_original_error() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource, fail_release=True)

    async def broken_child() -> None:
        raise KeyError("the original error")

    with pytest.RaisesGroup(
        pytest.RaisesExc(KeyError, match="the original error"), flatten_subgroups=True
    ) as caught:
        async with anyio.create_task_group() as owner:
            await owner.start(scope.run)
            scope.start_soon(broken_child)
    assert resource.released == 1
    # The scope's own group carries the note; the owner's group wraps it.
    notes = "\n".join(getattr(caught.value.exceptions[0], "__notes__", []))
    assert "deregistration failed" in notes


async def test_failing_release_alone_is_reported_with_its_cause() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource, fail_release=True)
    with pytest.RaisesGroup(ReleaseFailedError) as caught:
        async with anyio.create_task_group() as owner:
            await owner.start(scope.run)
            scope.wind_down()
    error = caught.value.exceptions[0]
    assert isinstance(error.__cause__, OSError)
    assert resource.released == 1


@pytest.mark.virtual_time
async def test_release_is_time_bounded() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource, hang_release=True, cleanup_timeout=5.0)
    start = anyio.current_time()
    with pytest.RaisesGroup(ReleaseFailedError) as caught:
        async with anyio.create_task_group() as owner:
            await owner.start(scope.run)
            scope.wind_down()
    assert isinstance(caught.value.exceptions[0].__cause__, TimeoutError)
    assert anyio.current_time() - start == pytest.approx(5.0)


@pytest.mark.virtual_time
async def test_deadline_ends_the_scope_by_itself() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource, deadline=anyio.current_time() + 180)

    async def stale_send() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            resource.use("send stopped")

    async with anyio.create_task_group() as owner:
        await owner.start(scope.run)
        scope.start_soon(stale_send)
        await scope.wait_closed()
    assert scope.expired
    assert resource.log == ["acquired", "send stopped", "released"]


@pytest.mark.virtual_time
async def test_deadline_can_be_moved_after_start() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource)
    async with anyio.create_task_group() as owner:
        await owner.start(scope.run)
        start = anyio.current_time()
        scope.deadline = start + 30
        await scope.wait_closed()
        assert anyio.current_time() - start == pytest.approx(30)
    assert scope.expired
    with pytest.raises(ScopeClosedError):
        scope.start_soon(anyio.sleep, 0)


async def test_call_returns_results_and_errors_without_disturbing_the_scope() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource)

    async def double(x: int) -> int:
        await anyio.lowlevel.checkpoint()
        return 2 * x

    async def broken() -> None:
        raise ValueError("bad input")

    async with anyio.create_task_group() as owner:
        await owner.start(scope.run)
        assert await scope.call(double, 21) == 42
        with pytest.raises(ValueError, match="bad input"):
            await scope.call(broken)
        assert scope.state is ScopeState.OPEN
        assert await scope.call(double, 1) == 2
        scope.wind_down()
    assert resource.released == 1


async def test_cancelled_caller_returns_only_after_the_child_ended() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource)
    in_forward = anyio.Event()
    finish_forward = anyio.Event()

    async def encode_job() -> str:
        with anyio.CancelScope(shield=True):
            in_forward.set()
            await finish_forward.wait()
            resource.use("forward finished")
        await anyio.lowlevel.checkpoint()
        resource.use("unreachable: the job was cancelled")
        return "staged"

    async def caller(cancel_scope: anyio.CancelScope) -> None:
        with cancel_scope:
            await scope.call(encode_job)
        resource.use("caller returned")

    caller_scope = anyio.CancelScope()
    async with anyio.create_task_group() as owner:
        await owner.start(scope.run)
        owner.start_soon(caller, caller_scope)
        await in_forward.wait()
        caller_scope.cancel()
        await anyio.wait_all_tasks_blocked()
        caller_scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert resource.log == ["acquired"]
        finish_forward.set()
        await anyio.wait_all_tasks_blocked()
        assert resource.log == ["acquired", "forward finished", "caller returned"]
        # The scope itself is untouched by the caller's cancellation.
        assert scope.state is ScopeState.OPEN
        scope.wind_down()
    assert caller_scope.cancelled_caught
    assert resource.released == 1


async def test_call_reports_a_scope_that_ended_under_it() -> None:
    scope = recording_scope(RecordingResource())

    async def caller() -> None:
        with pytest.raises(ScopeClosedError, match="ended before"):
            await scope.call(anyio.sleep_forever)

    async with anyio.create_task_group() as owner:
        await owner.start(scope.run)
        owner.start_soon(caller)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()


async def test_wind_down_before_start_still_releases() -> None:
    resource = RecordingResource()
    scope = recording_scope(resource)
    scope.wind_down()
    async with anyio.create_task_group() as owner:
        await owner.start(scope.run)
    assert resource.log == ["acquired", "released"]


async def test_failed_acquire_releases_nothing() -> None:
    async def acquire() -> int:
        raise MemoryError("no room")

    released: list[int] = []

    async def release(value: int) -> None:
        released.append(value)

    scope: OwningScope[int] = OwningScope(acquire, release)
    with pytest.raises(MemoryError):
        await scope.run()
    assert released == []
    assert scope.state is ScopeState.CLOSED


async def test_open_owning_scope_around_a_block() -> None:
    resource = RecordingResource()

    async def acquire() -> RecordingResource:
        return resource

    async def release(r: RecordingResource) -> None:
        r.released += 1
        r.log.append("released")

    gate = anyio.Event()

    async def child() -> None:
        await gate.wait()
        resource.use("child done")

    async with open_owning_scope(acquire, release, name="block") as scope:
        scope.start_soon(child)
        assert scope.resource is resource
        gate.set()
    assert resource.log == ["child done", "released"]

    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="body failed")):
        async with open_owning_scope(acquire, release) as scope:
            scope.start_soon(anyio.sleep_forever)
            raise RuntimeError("body failed")
    assert resource.released == 2
