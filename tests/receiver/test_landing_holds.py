"""Landing pages a write may still land in: held, asked about again, and the bound's policy;
and a receiver that closes while pages are held leaves its pool to the engine."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest
import torch

from encdisagg import BadRequestError, ServiceUnavailableError
from encdisagg.receiver import (
    EmbeddingReceiver,
    EncoderClient,
    MooncakeSendTarget,
    PageRun,
    PartMetadata,
    Recheck,
)
from encdisagg.transfer import HoldPolicy, LoopbackEngine, MemoryRegistrationState

pytestmark = pytest.mark.anyio

#: Two 256-byte pages: one part of 512 bytes takes the whole pool.
PAGES, PAGE_BYTES, PART_BYTES = 2, 256, 512


def _metadata(req_id: str) -> PartMetadata:
    return PartMetadata(
        req_id=req_id,
        part_idx=0,
        embedding_size=PART_BYTES,
        embedding_len=2,
        embedding_dim=64,
        token_counts=(2,),
        grid=((1, 2, 4),),
    )


def _receiver(engine: LoopbackEngine, **options: object) -> EmbeddingReceiver:
    return EmbeddingReceiver(
        transport="mooncake",
        hidden_size=64,
        dtype=torch.float32,
        engine=engine,
        landing_pages=PAGES,
        page_bytes=PAGE_BYTES,
        **options,  # type: ignore[arg-type]
    )


_PLANNER = EncoderClient(["http://e0"])


async def hold_pages(receiver: EmbeddingReceiver, rid: str, recheck: Recheck | None) -> None:
    """A request whose part was targeted and never confirmed stopped: its encoder answered
    neither ``/send`` nor ``/release``. With ``recheck``, the receiver may ask it again;
    without, nobody can be asked (its encoder is gone)."""
    async with receiver.expect(_PLANNER.plan(rid, {"image": ["x"]})) as pending:
        pending.note_metadata(_metadata(f"{rid}#0"))
        await pending.target(0)
        if recheck is not None:
            pending.hold_until_confirmed(0, recheck)


async def land(receiver: EmbeddingReceiver, rid: str) -> PageRun:
    """A request whose part landed (its ``/send`` returned); the run it got."""
    async with receiver.expect(_PLANNER.plan(rid, {"image": ["x"]})) as pending:
        pending.note_metadata(_metadata(f"{rid}#0"))
        target = await pending.target(0)
        pending.note_sent(0)
    assert isinstance(target, MooncakeSendTarget)
    start = (target.buffer_address - receiver.pool.ptr) // PAGE_BYTES
    return PageRun(start, PAGES)


async def never_confirms() -> bool:
    await anyio.lowlevel.checkpoint()
    return False


async def wait_until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.01)


# -- the bound, on both backends (short) and in virtual time (the default 60 s) -------------


@pytest.mark.parametrize("policy", ["retire", "reuse"])
async def test_the_bound_applies_the_policy(policy: str) -> None:
    async with (
        LoopbackEngine() as engine,
        _receiver(engine, quarantine_s=0.2, on_quarantine_timeout=policy) as receiver,
    ):
        await hold_pages(receiver, "a", never_confirms)
        stats = receiver.stats()
        assert (stats.quarantined_pages, stats.retired_pages, stats.held_pages) == (2, 0, 2)
        await wait_until(lambda: receiver.stats().quarantined_pages == 0)
        stats = receiver.stats()
        if policy == "retire":
            # Out of use for good: still held, never handed out.
            assert (stats.retired_pages, stats.held_pages, receiver.pool.available()) == (2, 2, 0)
        else:
            # Back in use, though a write may still land in them: the bytes stay held.
            assert (stats.retired_pages, stats.held_pages, receiver.pool.available()) == (0, 0, 2)
        assert stats.held_bytes == PART_BYTES


@pytest.mark.virtual_time
async def test_retire_keeps_unconfirmed_pages_out_of_use_for_good(
    caplog: pytest.LogCaptureFixture,
) -> None:
    asks: list[float] = []

    async def still_held() -> bool:
        asks.append(anyio.current_time())
        return False

    caplog.set_level(logging.WARNING, logger="encdisagg")
    async with LoopbackEngine() as engine, _receiver(engine, alloc_timeout_s=10.0) as receiver:
        start = anyio.current_time()
        await hold_pages(receiver, "a", still_held)
        await anyio.sleep(59.0)
        assert receiver.stats().quarantined_pages == 2
        # Asked again with backoff: 0.5 s, doubling, at most 5 s apart.
        offsets = [round(at - start, 3) for at in asks[:6]]
        assert offsets == [0.5, 1.5, 3.5, 7.5, 12.5, 17.5]
        await anyio.sleep(2.0)
        stats = receiver.stats()
        assert (stats.quarantined_pages, stats.retired_pages, stats.held_pages) == (0, 2, 2)
        assert (stats.held_bytes, stats.landing_pages_in_use) == (PART_BYTES, 0)
        asked = len(asks)
        async with receiver.expect(_PLANNER.plan("b", {"image": ["x"]})) as pending:
            pending.note_metadata(_metadata("b#0"))
            with pytest.raises(ServiceUnavailableError, match=r"no 2 free landing pages"):
                await pending.target(0)
        await anyio.sleep(3600.0)
        assert receiver.stats().retired_pages == 2
        assert len(asks) == asked  # past the bound, nobody asks any more
    retired = [r for r in caplog.records if "retired" in r.getMessage()]
    assert len(retired) == 1
    assert retired[0].levelno == logging.ERROR


@pytest.mark.virtual_time
async def test_reuse_hands_unconfirmed_pages_out_again_after_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="encdisagg")
    async with (
        LoopbackEngine() as engine,
        _receiver(engine, alloc_timeout_s=100.0, on_quarantine_timeout=HoldPolicy.REUSE) as rx,
    ):
        start = anyio.current_time()
        await hold_pages(rx, "a", never_confirms)
        run = await land(rx, "b")  # waits for the pages a's request holds
        assert anyio.current_time() - start == pytest.approx(60.0, abs=0.1)
        assert run == PageRun(0, 2)
        stats = rx.stats()
        assert (stats.held_pages, stats.quarantined_pages, stats.retired_pages) == (0, 0, 0)
        # Reused, yet a's write may still land: the pool stays held, and closes as held.
        assert stats.held_bytes == PART_BYTES
    reused = [r for r in caplog.records if "reused" in r.getMessage()]
    assert len(reused) == 1
    assert reused[0].levelno == logging.WARNING


# -- asking again ----------------------------------------------------------------------------


async def test_pages_come_back_once_the_encoder_confirms() -> None:
    answers = [False, True]

    async def encoder_answers() -> bool:
        await anyio.lowlevel.checkpoint()
        return answers.pop(0)

    async with LoopbackEngine() as engine, _receiver(engine) as receiver:
        await hold_pages(receiver, "a", encoder_answers)
        assert receiver.stats().held_pages == 2
        await wait_until(lambda: receiver.stats().held_pages == 0)
        assert answers == []
        stats = receiver.stats()
        assert (stats.held_bytes, stats.retired_pages, receiver.pool.available()) == (0, 0, 2)
        assert await land(receiver, "b") == PageRun(0, 2)


async def test_a_recheck_that_raises_counts_as_no_answer() -> None:
    calls = 0

    async def broken() -> bool:
        nonlocal calls
        calls += 1
        await anyio.lowlevel.checkpoint()
        if calls == 1:
            raise RuntimeError("no client")
        return True

    async with LoopbackEngine() as engine, _receiver(engine) as receiver:
        await hold_pages(receiver, "a", broken)
        await wait_until(lambda: receiver.stats().held_pages == 0)
        assert calls == 2


# -- closing (finding 7) ---------------------------------------------------------------------


async def test_closing_while_pages_are_held_leaves_the_pool_to_the_engine() -> None:
    engine = LoopbackEngine()
    try:
        receiver = _receiver(engine)
        async with receiver:
            # Its encoder is gone: nobody can say the write ended.
            await hold_pages(receiver, "a", None)
            buffer = weakref.ref(receiver.pool.buffer)
            registration = receiver.pool.registration
            assert registration is not None
        # Neither deregistered nor freed: a write may still land in it.
        assert engine.registered_regions() == 1
        assert registration.state is MemoryRegistrationState.LEFT
        del receiver, registration
        gc.collect()
        assert buffer() is not None
    finally:
        engine.close()
    gc.collect()
    assert buffer() is None


async def test_closing_waits_for_an_ask_that_confirms_then_deregisters() -> None:
    asks = 0

    async def confirms() -> bool:
        nonlocal asks
        asks += 1
        await anyio.lowlevel.checkpoint()
        return True

    async with LoopbackEngine() as engine:
        receiver = _receiver(engine)
        async with receiver:
            await hold_pages(receiver, "a", confirms)
            registration = receiver.pool.registration
            assert registration is not None
        # Leaving waited for the ask, 0.5 s on: settled, then deregistered.
        assert asks == 1
        assert registration.state is MemoryRegistrationState.DEREGISTERED
        assert engine.registered_regions() == 0
        assert receiver.stats().held_bytes == 0


async def test_closing_without_holds_deregisters_and_frees_the_pool() -> None:
    async with LoopbackEngine() as engine:
        receiver = _receiver(engine)
        async with receiver:
            await land(receiver, "a")
            buffer = weakref.ref(receiver.pool.buffer)
        assert engine.registered_regions() == 0
        del receiver
        gc.collect()
        assert buffer() is None


# -- options ---------------------------------------------------------------------------------


def test_the_quarantine_options_are_checked() -> None:
    engine = LoopbackEngine()
    with pytest.raises(BadRequestError, match=r"on_quarantine_timeout must be one of 'retire', "):
        _receiver(engine, on_quarantine_timeout="keep")
    with pytest.raises(BadRequestError, match="quarantine_s must be a non-negative number"):
        _receiver(engine, quarantine_s=-1.0)
    assert _receiver(engine, on_quarantine_timeout="reuse").on_quarantine_timeout is (
        HoldPolicy.REUSE
    )
    assert _receiver(engine).on_quarantine_timeout is HoldPolicy.RETIRE
    engine.close()
