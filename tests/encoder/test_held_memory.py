"""Memory a Mooncake write may still read after the Encoder stopped waiting for it.

A real :class:`MooncakeEngine` runs over a scripted stand-in for Mooncake's pybind engine
(``_mooncake_fakes``) whose writes the test leaves unfinished: Mooncake answers TIMED_OUT, or
its synchronous call gives up with -1, while the write runs on. The memory it reads must not
be deregistered, freed or handed to another request until Mooncake reports the write ended
(or the engine is destroyed); the send reports the outcome as unknown (504), and so does a
release of the request.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from encdisagg import Encoder, EncoderConfig, EncodeRequest, MooncakeDestination, TransferError
from encdisagg.transfer import MooncakeEngine

from ._engine_fakes import AuditingEngine, letting_go
from ._mooncake_fakes import ScriptedMooncake, scripted_mooncake
from .fakes import ScriptedModel

pytestmark = pytest.mark.anyio

__all__ = ["scripted_mooncake"]

MakeEncoder = Callable[..., Encoder]
TOKENS = 64  # 64 x 8 float16: 1 KiB, a 4 KiB arena block
#: 640 KiB: one such embedding fills the 1 MiB arena, so the next one would reuse its block.
ARENA_FILLING_TOKENS = 40_000
PEER = MooncakeDestination("peer:1", 0x7000_0000, "peer:1")


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.005)


async def send_unknown(encoder: Encoder, req_id: str, tokens: int = TOKENS) -> TransferError:
    """Encode ``req_id`` and send it: the write's outcome is unknown."""
    await encoder.encode(EncodeRequest(req_id, [tokens]))
    with pytest.raises(TransferError) as raised:
        await encoder.send(req_id, PEER)
    return raised.value


@pytest.mark.parametrize("outcome", ["timeout", "running"])
@pytest.mark.parametrize("write", ["first-write", "later-write"])
@pytest.mark.parametrize(
    "arena", [{"staging_arena_mb": 0}, {"staging_arena_mb": 1}], ids=["own-region", "arena"]
)
async def test_a_write_with_an_unknown_outcome_holds_its_memory_until_it_ended(
    make_encoder: MakeEncoder,
    scripted_mooncake: ScriptedMooncake,
    outcome: str,
    write: str,
    arena: dict[str, Any],
) -> None:
    # Finding 1: a TIMED_OUT answer (or a write outliving Mooncake's bound) held arena
    # blocks only: an embedding in its own registered tensor was deregistered at once.
    # Finding 2: the first write to a session went through Mooncake's synchronous call,
    # whose give-up (-1) read as a plain failure: nothing was held, and the arena block went
    # to the next request.
    fake = scripted_mooncake
    async with make_encoder(transfer="mooncake", **arena) as encoder:
        if write == "later-write":
            await encoder.encode(EncodeRequest("warm", [TOKENS]))
            await encoder.send("warm", PEER)
        fake.plan = [outcome]
        error = await send_unknown(encoder, "r1", ARENA_FILLING_TOKENS)
        # The next request is staged elsewhere and sent: nothing of r1's memory is reused.
        await encoder.encode(EncodeRequest("r2", [ARENA_FILLING_TOKENS]))
        await encoder.send("r2", PEER)
        await anyio.sleep(0.05)
        assert fake.violations == []
        assert error.status == 504, error
        assert "'r1'" in str(error)
        assert encoder.stats().held_bytes > 0
        assert fake.unfinished()
        fake.finish()
        await until(lambda: encoder.stats().held_bytes == 0)
        await until(lambda: encoder.stats().staged_bytes == 0)
    assert fake.violations == []


async def test_a_release_of_a_held_request_says_its_write_may_still_land(
    make_encoder: MakeEncoder, scripted_mooncake: ScriptedMooncake
) -> None:
    # Finding 3, the encoder's side: release answered as for a clean end, so prefill took
    # the write as stopped and reused its landing pages.
    fake = scripted_mooncake
    fake.plan = ["timeout"]
    async with make_encoder(transfer="mooncake", staging_arena_mb=0) as encoder:
        await send_unknown(encoder, "r1")
        for _ in range(2):  # idempotent: asked again, the same answer
            with pytest.raises(TransferError) as raised:
                await encoder.release("r1")
            assert raised.value.status == 504
            assert "unknown outcome" in str(raised.value)
        fake.finish()
        await until(lambda: encoder.stats().held_bytes == 0)
        await encoder.release("r1")  # once the write ended: a clean release
    assert fake.violations == []


@pytest.mark.parametrize("arena_mb", [0, 1], ids=["own-region", "arena"])
async def test_closing_an_encoder_that_owns_its_engine_waits_and_deregisters_nothing_held(
    scripted_mooncake: ScriptedMooncake, arena_mb: int
) -> None:
    # Finding 4: with a write running past shutdown_grace_s and cleanup_timeout_s, closing
    # deregistered the arena and own regions under it (the engine's exit deregistered every
    # leftover), and with the arena off the late job's exit raised ClosedResourceError into
    # the sender's task.
    fake = scripted_mooncake
    fake.plan = ["running"]
    config = EncoderConfig(
        transfer="mooncake",
        staging_arena_mb=arena_mb,
        shutdown_grace_s=0.01,
        cleanup_timeout_s=0.05,
    )
    raised: list[BaseException] = []

    async def send(encoder: Encoder) -> None:
        try:
            await encoder.send("r1", PEER)
        except Exception as exc:
            raised.append(exc)

    async with (
        anyio.create_task_group() as outer,
        Encoder(config, model=ScriptedModel()) as encoder,
    ):
        await encoder.encode(EncodeRequest("r1", [TOKENS]))
        outer.start_soon(send, encoder)
        await until(lambda: bool(fake.unfinished()))
    assert fake.violations == []
    [error] = raised
    assert isinstance(error, TransferError), error
    assert error.status == 504
    fake.finish()


async def test_memory_held_at_close_lives_as_long_as_the_callers_engine(
    scripted_mooncake: ScriptedMooncake,
) -> None:
    # Finding 5: memory kept out of use lived only as long as the Encoder object: dropped
    # after close, it freed its arena while the arena was registered with the caller's
    # engine and a write might still read it.
    fake = scripted_mooncake
    fake.plan = ["timeout"]
    config = EncoderConfig(transfer="mooncake", staging_arena_mb=1, cleanup_timeout_s=0.05)
    async with MooncakeEngine() as engine:
        encoder = Encoder(config, model=ScriptedModel(), engine=engine)
        async with encoder:
            await send_unknown(encoder, "r1")
            regions = encoder._regions
            assert regions is not None
            assert regions.arena is not None
            arena = weakref.ref(regions.arena.buffer)
            del regions
        del encoder
        gc.collect()
        assert arena() is not None, "the held arena was freed with the encoder"
        assert engine.registered_regions() == 1
        assert fake.violations == []
    # The engine was destroyed: no write touches the arena any more, and it may go.
    gc.collect()
    assert arena() is None
    assert fake.violations == []
    fake.finish()


async def test_a_failed_arena_deregistration_at_close_is_retried(
    scripted_mooncake: ScriptedMooncake,
) -> None:
    # Finding 6: one transient failure left the arena registered with the caller's engine.
    fake = scripted_mooncake
    config = EncoderConfig(transfer="mooncake", staging_arena_mb=1, cleanup_timeout_s=5.0)
    async with MooncakeEngine() as engine:
        async with Encoder(config, model=ScriptedModel(), engine=engine) as encoder:
            await encoder.encode(EncodeRequest("r1", [TOKENS]))
            await encoder.send("r1", PEER)
            fake.unregister_failures = 1
        assert engine.registered_regions() == 0
        assert encoder.stats().registered_regions == 0
    assert fake.violations == []


async def test_a_copy_that_fails_while_staging_gives_its_bytes_back(
    make_encoder: MakeEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Finding 11: a staging copy that failed (out of memory) kept its reserved bytes, so
    # under staged_memory_limit_mb the encoder ended up refusing every request (503).
    from encdisagg.encoder._staging._arena import StagingArena

    real_stage = StagingArena.stage
    failures = [RuntimeError("CUDA out of memory (simulated)")]

    def failing_stage(self: StagingArena, *args: Any, **kwargs: Any) -> int | None:
        if failures:
            raise failures.pop()
        return real_stage(self, *args, **kwargs)

    monkeypatch.setattr(StagingArena, "stage", failing_stage)
    async with make_encoder(staging_arena_mb=1, staged_memory_limit_mb=1) as encoder:
        with pytest.raises(Exception, match="out of memory"):
            await encoder.encode(EncodeRequest("r1", [TOKENS]))
        assert encoder.stats().staged_bytes == 0
        for index in range(3):
            await encoder.encode(EncodeRequest(f"ok{index}", [TOKENS]))
            await encoder.release(f"ok{index}")
        assert encoder.stats().staged_bytes == 0


async def test_a_cancelled_start_deregisters_the_arena_it_registered() -> None:
    # Finding 10: cancelling ``async with Encoder`` while the engine registered the arena
    # left the registration on the caller's engine, and freed the buffer under it.
    engine = AuditingEngine()
    gate = engine.hold("register", 1)
    config = EncoderConfig(staging_arena_mb=1)

    async def start() -> None:
        async with Encoder(config, model=ScriptedModel(), engine=engine):
            pytest.fail("the encoder opened")

    with anyio.CancelScope() as scope, letting_go(gate):
        async with anyio.create_task_group() as group:
            group.start_soon(start)
            await gate.entered.wait()
            scope.cancel()
            gate.let_go()
    assert scope.cancelled_caught
    assert engine.registered
    assert engine.deregistered == engine.registered
    assert engine.live == {}
    assert engine.violations == []
