"""Who owns an engine registration, and when it may be deregistered (DESIGN.md §6 rules 2, 8
and 14): once, by one owner, never under a write, within the cleanup bound.

These tests make the Encoder register its staged memory per request (the staging arena,
where there is one, is turned off), because the failures they script happen there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from encdisagg import (
    Encoder,
    EncoderConfig,
    EncodeRequest,
    MooncakeDestination,
    TransferError,
)

from ._engine_fakes import AuditingEngine, letting_go
from .fakes import RecordingEngine

pytestmark = pytest.mark.anyio

MakeEncoder = Callable[..., Encoder]

#: Where the fake receivers' buffers are; AuditingEngine copies nothing.
REMOTE_A = 0x10_0000
REMOTE_B = 0x20_0000


def per_request_registration(**fields: Any) -> dict[str, Any]:
    """Config fields for an encoder that registers each request's memory on its own."""
    if "staging_arena_mb" in EncoderConfig.__dataclass_fields__:
        fields.setdefault("staging_arena_mb", 0)
    return fields


def request(req_id: str = "r1", tokens: int = 4) -> EncodeRequest:
    return EncodeRequest(req_id, [tokens])


def destination(engine: AuditingEngine, address: int, endpoint: str) -> MooncakeDestination:
    return MooncakeDestination(engine.session_id, address, endpoint)


async def until(condition: Callable[[], bool]) -> None:
    """Checkpoint until ``condition()`` holds.

    For a state the encoder reaches just after it handled a worker thread's result, which
    no event announces; the caller bounds the wait with ``fail_after``."""
    while not condition():
        await anyio.lowlevel.checkpoint()


def assert_idle(encoder: Encoder) -> None:
    stats = encoder.stats()
    assert (stats.live_requests, stats.staged_bytes, stats.registered_regions) == (0, 0, 0), stats
    assert stats.inflight_transfers == 0, stats


class Lifetime:
    """Keeps an encoder open in a task of its own, so that the test can act (let held
    engine calls go) while the encoder closes. Records what leaving ``async with`` raised."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self.close = anyio.Event()
        self.raised: list[Exception] = []

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            async with self.encoder:
                task_status.started()
                await self.close.wait()
        except Exception as exc:
            self.raised.append(exc)


async def send_recording(
    encoder: Encoder,
    req_id: str,
    to: MooncakeDestination,
    outcomes: dict[str, BaseException | None],
    receive_count: int | None = None,
) -> None:
    try:
        await encoder.send(req_id, to, receive_count=receive_count)
    except Exception as exc:
        outcomes[to.endpoint] = exc
    else:
        outcomes[to.endpoint] = None


# -- finding 1: an orphaned region has one owner at a time ---------------------------------


async def test_closing_while_an_orphan_is_retried_deregisters_it_once(
    make_encoder: MakeEncoder,
) -> None:
    engine = AuditingEngine()
    engine.fail("deregister", 1)  # the request's own deregistration: the region is orphaned
    retry = engine.hold("deregister", 2)
    # Only an encoder that deregisters the region twice makes a third call.
    second_owner = engine.hold("deregister", 3)
    # A short bound: an encoder may wait that long for a held deregistration.
    lifetime = Lifetime(
        make_encoder(engine=engine, **per_request_registration(cleanup_timeout_s=1))
    )
    encoder = lifetime.encoder
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(lifetime.run)
            with letting_go(retry, second_owner):
                await encoder.encode(request("r1"))
                await encoder.release("r1")
                assert encoder.stats().registered_regions == 1
                # The first retry, if it comes soon; the close meets it in flight.
                with anyio.move_on_after(5):
                    await retry.entered.wait()
                lifetime.close.set()
                await anyio.wait_all_tasks_blocked()
                retry.let_go()
                # Whoever holds the held call finishes with the region first ...
                await until(lambda: encoder.stats().registered_regions == 0)
                # ... and only then would a second owner's call return.
                second_owner.let_go()
    assert lifetime.raised == []
    assert engine.deregistered == engine.registered
    assert engine.violations == []
    assert_idle(encoder)


@pytest.mark.virtual_time
async def test_the_retrier_leaves_alone_an_orphan_the_final_sweep_deregisters(
    make_encoder: MakeEncoder,
) -> None:
    engine = AuditingEngine()
    engine.fail("deregister", 1)  # orphaned at release
    sweep = engine.hold("deregister", 2)  # closing right away: the final sweep's call waits
    lifetime = Lifetime(make_encoder(engine=engine, **per_request_registration()))
    encoder = lifetime.encoder
    with anyio.fail_after(600):
        async with anyio.create_task_group() as tg:
            await tg.start(lifetime.run)
            with letting_go(sweep):
                await encoder.encode(request("r1"))
                await encoder.release("r1")
                lifetime.close.set()
                await sweep.entered.wait()
                # Virtual time: long past the retrier's first back-off, and past the
                # sweep's own bound (cleanup_timeout_s), which closes the encoder while
                # the call is still held.
                await anyio.sleep(30)
        # The held call was left running, keeping the memory alive and counted; once the
        # engine lets go, it gives the bytes back.
        await until(lambda: encoder.stats().staged_bytes == 0)
    assert lifetime.raised == []
    assert engine.deregistered == engine.registered
    assert engine.violations == []
    assert_idle(encoder)


# -- finding 2: a request's region is never shared with the encoder's orphan list ----------


async def test_a_failed_per_send_deregistration_does_not_fail_the_send_or_share_the_region(
    make_encoder: MakeEncoder,
) -> None:
    engine = AuditingEngine()
    engine.fail("register", 1)  # the shared registration: sends fall back to their own
    engine.fail("deregister", 1)  # the first deregistration of the staged memory
    first_write = engine.hold("write", 1)
    outcomes: dict[str, BaseException | None] = {}
    async with make_encoder(engine=engine, **per_request_registration()) as encoder:
        await encoder.encode(request("r1"))
        a = destination(engine, REMOTE_A, "a:1")
        b = destination(engine, REMOTE_B, "b:1")
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                with letting_go(first_write):
                    tg.start_soon(send_recording, encoder, "r1", a, outcomes, 2)
                    await first_write.entered.wait()
                    tg.start_soon(send_recording, encoder, "r1", b, outcomes)
                    await anyio.wait_all_tasks_blocked()
                    first_write.let_go()
    # Both writes succeeded: both sends returned normally.
    assert outcomes == {"a:1": None, "b:1": None}
    assert engine.violations == []
    assert engine.calls("write") == 2
    # The second send wrote from the registration the first one made.
    assert sorted(engine.registered.values()) == [1]
    assert engine.deregistered == engine.registered
    assert_idle(encoder)


@pytest.mark.virtual_time
async def test_no_deregistration_runs_under_a_later_send_of_the_same_memory(
    make_encoder: MakeEncoder,
) -> None:
    engine = AuditingEngine()
    engine.fail("register", 1)
    engine.fail("deregister", 1)
    first_write = engine.hold("write", 1)
    second_write = engine.hold("write", 2)
    outcomes: dict[str, BaseException | None] = {}
    async with make_encoder(engine=engine, **per_request_registration()) as encoder:
        await encoder.encode(request("r1"))
        a = destination(engine, REMOTE_A, "a:1")
        b = destination(engine, REMOTE_B, "b:1")
        with anyio.fail_after(600):
            async with anyio.create_task_group() as tg:
                with letting_go(first_write, second_write):
                    tg.start_soon(send_recording, encoder, "r1", a, outcomes, 2)
                    await first_write.entered.wait()
                    tg.start_soon(send_recording, encoder, "r1", b, outcomes)
                    await anyio.wait_all_tasks_blocked()
                    first_write.let_go()
                    await second_write.entered.wait()
                    # Virtual time: long past any retry of the failed deregistration.
                    await anyio.sleep(30)
    assert engine.violations == []
    assert outcomes == {"a:1": None, "b:1": None}
    assert engine.deregistered == engine.registered
    assert_idle(encoder)


async def test_a_region_a_later_send_reused_is_not_left_behind(
    make_encoder: MakeEncoder,
) -> None:
    # This engine refuses to deregister a region it does not hold, as a real one may: a
    # region whose ownership was split between the request and the encoder then stays.
    engine = RecordingEngine(register_failure_rate=1.0, deregister_failures=1)
    engine.write_gate = threading.Event()
    engine.write_started = anyio.Event()
    outcomes: dict[str, BaseException | None] = {}
    async with make_encoder(engine=engine, **per_request_registration()) as encoder:
        result = await encoder.encode(request("r1"))
        engine.register_failure_rate = 0.0
        a, b = (
            MooncakeDestination(
                engine.session_id, engine.add_remote_buffer(result.nbytes).data_ptr(), endpoint
            )
            for endpoint in ("a:1", "b:1")
        )
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send_recording, encoder, "r1", a, outcomes, 2)
                await engine.write_started.wait()
                tg.start_soon(send_recording, encoder, "r1", b, outcomes)
                await anyio.wait_all_tasks_blocked()
                engine.write_gate.set()
    assert_idle(encoder)
    assert engine.regions == {}
    assert engine.violations == []
    assert outcomes == {"a:1": None, "b:1": None}


# -- finding 3: the cleanup bound bounds the caller, not the memory's safety ----------------


def error_reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.ERROR or "ReleaseFailedError" in (record.exc_text or "")
    ]


async def _returns_within_the_cleanup_bound(
    make_encoder: MakeEncoder,
    caplog: pytest.LogCaptureFixture,
    finish: Callable[[Encoder, AuditingEngine], Awaitable[None]],
    what: str,
) -> None:
    """``finish`` ends r1's lifecycle while its deregistration blocks: it must return within
    cleanup_timeout_s, keep the memory counted, and report nothing."""
    caplog.set_level(logging.DEBUG, logger="encdisagg")
    engine = AuditingEngine()
    deregistration = engine.hold("deregister", 1)
    async with make_encoder(
        engine=engine, **per_request_registration(cleanup_timeout_s=0.2)
    ) as encoder:
        result = await encoder.encode(request("r1"))
        with letting_go(deregistration):
            with anyio.move_on_after(5) as waiting:
                await finish(encoder, engine)
                await deregistration.entered.wait()
            staged_while_blocked = encoder.stats().staged_bytes
    assert not waiting.cancelled_caught, f"{what} waited for the blocked deregistration"
    # Still registered, so still counted: the memory was not free yet.
    assert staged_while_blocked >= result.nbytes
    # The deregistration was slow, not failed: nothing to report.
    assert error_reports(caplog) == []
    assert "ReleaseFailedError" not in caplog.text
    assert engine.deregistered == engine.registered
    assert_idle(encoder)


async def test_release_returns_within_the_cleanup_bound_while_deregistration_blocks(
    make_encoder: MakeEncoder, caplog: pytest.LogCaptureFixture
) -> None:
    async def release(encoder: Encoder, engine: AuditingEngine) -> None:
        await encoder.release("r1")

    await _returns_within_the_cleanup_bound(make_encoder, caplog, release, "release")


async def test_the_last_send_returns_within_the_cleanup_bound_and_reports_no_failure(
    make_encoder: MakeEncoder, caplog: pytest.LogCaptureFixture
) -> None:
    async def send(encoder: Encoder, engine: AuditingEngine) -> None:
        await encoder.send("r1", destination(engine, REMOTE_A, "a:1"))

    await _returns_within_the_cleanup_bound(make_encoder, caplog, send, "the send")


@pytest.mark.virtual_time
async def test_a_late_release_waits_for_the_deregistration_under_way(
    make_encoder: MakeEncoder,
) -> None:
    # The request's own deadline freed it, so nobody waited for its deregistration; a
    # release that comes after returns only once that deregistration was tried.
    engine = AuditingEngine()
    deregistration = engine.hold("deregister", 1)
    returned: list[str] = []
    async with make_encoder(
        engine=engine, **per_request_registration(send_timeout_s=10, cleanup_timeout_s=1e6)
    ) as encoder:
        with letting_go(deregistration):
            await encoder.encode(request("r1"))
            await deregistration.entered.wait()  # expired and freed; its region is held
            assert encoder.stats().live_requests == 0

            async def release() -> None:
                await encoder.release("r1")
                returned.append("release")

            async with anyio.create_task_group() as tg:
                tg.start_soon(release)
                await anyio.wait_all_tasks_blocked()
                assert returned == []
                assert encoder.stats().staged_bytes > 0
                deregistration.let_go()
        assert returned == ["release"]
        assert_idle(encoder)
    assert engine.deregistered == engine.registered


# -- finding 6: a failed deregistration after a failed write is reported -------------------


async def test_a_failed_deregistration_after_a_failed_write_is_reported(
    make_encoder: MakeEncoder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="encdisagg")
    engine = AuditingEngine()
    engine.fail("register", 1)  # per-send registration from here on
    engine.fail("write", 1)
    engine.fail("deregister", 1)
    async with make_encoder(engine=engine, **per_request_registration()) as encoder:
        await encoder.encode(request("r1"))
        with anyio.fail_after(10), pytest.raises(TransferError) as caught:
            await encoder.send("r1", destination(engine, REMOTE_A, "a:1"))
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # The caller hears about the write ...
    assert "injected write failure" in caught.value.message
    # ... and the deregistration failure is not lost: logged, or noted on the error.
    notes = getattr(caught.value, "__notes__", [])
    reports = [text for text in [*notes, *logged] if "deregist" in text.lower()]
    assert reports, (notes, logged)
    assert engine.deregistered == engine.registered
    assert_idle(encoder)
