"""The staging arena inside the Encoder: one registration for every request that fits, a
request's own registration (deregistered once) for every one that does not."""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import torch

from encdisagg import Encoder, EncodeRequest, EncodeResult, Modality, MooncakeDestination
from encdisagg.models import Preprocessed
from encdisagg.transfer import Hold, LoopbackEngine, LoopbackFabric

from ._device_models import DeviceScriptedModel
from .fakes import RecordingEngine, ScriptedModel

pytestmark = pytest.mark.anyio

MakeEncoder = Callable[..., Encoder]

#: float32 rows of 256 values: 1 KiB a token, values exact far past the sizes used here.
HIDDEN = 256
KIB = 1024


def wide_model() -> ScriptedModel:
    return ScriptedModel(hidden_size=HIDDEN, dtype=torch.float32)


def expected(model: ScriptedModel, tokens: int) -> torch.Tensor:
    pre = model.preprocess([tokens], Modality.IMAGE)
    return torch.cat(model.forward([pre]))


def landed(buffer: torch.Tensor, result: EncodeResult) -> torch.Tensor:
    return buffer.view(torch.float32).reshape(result.num_tokens, result.hidden_size)


def arena_blocks(encoder: Encoder) -> int:
    regions = encoder._regions
    assert regions is not None
    assert regions.arena is not None
    return regions.arena.allocated


def register_counts(engine: RecordingEngine) -> tuple[Counter[str], Counter[str]]:
    """How many times each pointer was registered, and deregistered."""
    registered: Counter[str] = Counter()
    deregistered: Counter[str] = Counter()
    for line in engine.log:
        verb, _, ptr = line.partition(" ")
        if verb == "register":
            registered[ptr] += 1
        elif verb == "deregister":
            deregistered[ptr] += 1
    return registered, deregistered


async def deliver(
    encoder: Encoder, engine: RecordingEngine, model: ScriptedModel, result: EncodeResult
) -> None:
    buffer = engine.add_remote_buffer(result.nbytes)
    destination = MooncakeDestination(engine.session_id, buffer.data_ptr(), "prefill:1")
    await encoder.send(result.req_id, destination)
    tokens = result.num_tokens
    assert torch.equal(landed(buffer, result), expected(model, tokens))


async def test_every_request_that_fits_uses_the_one_arena_registration(
    make_encoder: MakeEncoder,
) -> None:
    model, engine = wide_model(), RecordingEngine()
    async with make_encoder(model=model, engine=engine, staging_arena_mb=1) as encoder:
        assert engine.registrations == 1
        assert encoder.stats().registered_regions == 1
        for index in range(6):
            result = await encoder.encode(EncodeRequest(f"r{index}", [100 + index]))
            assert encoder.stats().staged_bytes == result.nbytes
            assert arena_blocks(encoder) == 1
            await deliver(encoder, engine, model, result)
            stats = encoder.stats()
            assert (stats.live_requests, stats.staged_bytes) == (0, 0)
            assert stats.registered_regions == 1
            assert arena_blocks(encoder) == 0
        # Concurrent ones share the arena too.
        results = [await encoder.encode(EncodeRequest(f"c{i}", [50 + i])) for i in range(4)]
        assert arena_blocks(encoder) == 4
        async with anyio.create_task_group() as tg:
            for result in results:
                tg.start_soon(deliver, encoder, engine, model, result)
        assert engine.registrations == 1
        assert engine.deregistrations == 0
        assert encoder.stats().registered_regions == 1
        assert encoder.stats().staged_bytes == 0
    assert encoder.stats().registered_regions == 0
    assert engine.deregistrations == 1
    assert engine.regions == {}
    assert engine.violations == []


async def test_a_full_arena_falls_back_to_an_own_registration_deregistered_once(
    make_encoder: MakeEncoder,
) -> None:
    model, engine = wide_model(), RecordingEngine()
    async with make_encoder(model=model, engine=engine, staging_arena_mb=1) as encoder:
        # 600 KiB takes a 1 MiB block: the whole arena.
        first = await encoder.encode(EncodeRequest("fills", [600]))
        assert arena_blocks(encoder) == 1
        second = await encoder.encode(EncodeRequest("falls-back", [300]))
        # Bigger than the arena itself: never fits.
        third = await encoder.encode(EncodeRequest("too-big", [1100]))
        assert arena_blocks(encoder) == 1
        assert engine.registrations == 3
        assert encoder.stats().registered_regions == 3
        assert encoder.stats().staged_bytes == first.nbytes + second.nbytes + third.nbytes
        for result in (second, first, third):
            await deliver(encoder, engine, model, result)
        assert engine.deregistrations == 2
        assert encoder.stats().registered_regions == 1
        assert encoder.stats().staged_bytes == 0
        # The arena is free again: the next request fits and registers nothing.
        again = await encoder.encode(EncodeRequest("fits-again", [300]))
        assert arena_blocks(encoder) == 1
        await deliver(encoder, engine, model, again)
        assert engine.registrations == 3
    registered, deregistered = register_counts(engine)
    assert registered == deregistered
    assert set(registered.values()) == {1}
    assert engine.violations == []


async def test_many_concurrent_requests_overflow_the_arena_and_each_fallback_once(
    make_encoder: MakeEncoder,
) -> None:
    model, engine = wide_model(), RecordingEngine()
    async with make_encoder(model=model, engine=engine, staging_arena_mb=1) as encoder:
        results: list[EncodeResult] = []

        async def encode(req_id: str) -> None:
            # 200 KiB takes a 256 KiB block: four fit.
            results.append(await encoder.encode(EncodeRequest(req_id, [200])))

        async with anyio.create_task_group() as tg:
            for index in range(12):
                tg.start_soon(encode, f"r{index}")
        assert arena_blocks(encoder) == 4
        assert engine.registrations == 1 + 8
        assert encoder.stats().staged_bytes == sum(r.nbytes for r in results)
        async with anyio.create_task_group() as tg:
            for result in results:
                tg.start_soon(deliver, encoder, engine, model, result)
        assert engine.deregistrations == 8
        stats = encoder.stats()
        assert (stats.live_requests, stats.staged_bytes, stats.registered_regions) == (0, 0, 1)
        assert arena_blocks(encoder) == 0
    registered, deregistered = register_counts(engine)
    assert registered == deregistered
    assert len(registered) == 9
    assert set(registered.values()) == {1}
    assert engine.violations == []


async def test_no_arena_is_registered_with_staging_arena_mb_zero(
    make_encoder: MakeEncoder,
) -> None:
    model, engine = wide_model(), RecordingEngine()
    async with make_encoder(model=model, engine=engine, staging_arena_mb=0) as encoder:
        assert engine.registrations == 0
        assert encoder.stats().registered_regions == 0
        assert encoder._regions is not None
        assert encoder._regions.arena is None
        for index in range(3):
            result = await encoder.encode(EncodeRequest(f"r{index}", [64]))
            assert encoder.stats().registered_regions == 1
            await deliver(encoder, engine, model, result)
            assert encoder.stats().registered_regions == 0
        assert engine.registrations == engine.deregistrations == 3
    assert engine.violations == []


async def test_loopback_delivers_exact_bytes_from_the_arena(make_encoder: MakeEncoder) -> None:
    model = wide_model()
    fabric = LoopbackFabric()
    async with (
        LoopbackEngine(fabric, name="encoder") as engine,
        LoopbackEngine(fabric, name="prefill") as prefill,
    ):
        async with make_encoder(model=model, engine=engine, staging_arena_mb=1) as encoder:
            assert engine.registered_regions() == 1
            landing = torch.zeros(1100 * KIB, dtype=torch.uint8)
            prefill.register(landing.data_ptr(), landing.numel())
            for index, tokens in enumerate((100, 600, 1100, 37)):
                result = await encoder.encode(EncodeRequest(f"r{index}", [tokens]))
                # Only the one bigger than the arena registers its own memory.
                assert engine.registered_regions() == (2 if tokens == 1100 else 1)
                destination = MooncakeDestination("prefill", landing.data_ptr(), "prefill:1")
                await encoder.send(result.req_id, destination)
                got = landed(landing[: result.nbytes], result)
                assert torch.equal(got, expected(model, tokens))
                stats = encoder.stats()
                assert (stats.live_requests, stats.staged_bytes) == (0, 0)
                assert stats.registered_regions == engine.registered_regions() == 1
            prefill.deregister(landing.data_ptr())
        assert engine.registered_regions() == 0
        assert encoder.stats().registered_regions == 0


# -- a CUDA model: the bytes must be final before the engine reads them ---------------------


class QueuedCudaModel(ScriptedModel):
    """A blocking model on CUDA whose forward returns while its kernels are still queued
    (as a real tower's does): a long sleep kernel runs ahead of the rows' own."""

    def __init__(self) -> None:
        super().__init__(hidden_size=HIDDEN, dtype=torch.float32)
        self.device = torch.device("cuda", 0)

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        # Kernels only, no host copy that could wait for them: about half a second of
        # queued device work when this returns.
        torch.cuda._sleep(1 << 30)  # type: ignore[no-untyped-call]
        outputs = []
        for pre in batch:
            tokens = sum(pre.token_counts)
            values = torch.arange(tokens * HIDDEN, dtype=torch.float32, device=self.device)
            outputs.append(values.reshape(tokens, HIDDEN))
        return outputs


@dataclass(eq=False)
class StreamCheckingEngine:
    """A transfer engine that reads device memory the way a NIC does, outside any CUDA
    stream: it notes whether the device still had queued work when a write began."""

    session_id: str = "stream-checking:1"
    regions: dict[int, int] = field(default_factory=dict)
    writes_while_busy: int = 0
    writes: int = 0

    def register(self, ptr: int, nbytes: int) -> None:
        self.regions[ptr] = nbytes

    def deregister(self, ptr: int) -> None:
        del self.regions[ptr]

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        self.writes += 1
        if not torch.cuda.default_stream(torch.device("cuda", 0)).query():
            self.writes_while_busy += 1


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "staging_arena_mb",
    [1, 0],
    ids=["arena", "own-registration"],
)
async def test_no_write_reads_staged_cuda_memory_before_it_is_final(
    make_encoder: MakeEncoder, staging_arena_mb: int
) -> None:
    engine = StreamCheckingEngine()
    model = QueuedCudaModel()
    async with make_encoder(model=model, engine=engine, staging_arena_mb=staging_arena_mb) as enc:
        result = await enc.encode(EncodeRequest("gpu", [64]))
        await enc.send("gpu", MooncakeDestination(engine.session_id, 1 << 20, "prefill:1"))
        assert result.num_tokens == 64
    torch.cuda.synchronize()
    assert engine.writes == 1
    assert engine.writes_while_busy == 0


def _arena_owner(engine: RecordingEngine) -> tuple[Any, Any]:
    from encdisagg.encoder._staging._budget import StagedBudget
    from encdisagg.encoder._staging._owner import RegionOwner

    budget = StagedBudget(None)
    owner = RegionOwner(
        engine,
        budget,
        arena_bytes=4 * 4096,
        device=torch.device("cpu"),
        cleanup_timeout_s=0.5,
        clock=anyio.current_time,
    )
    return owner, budget


async def test_a_held_arena_block_is_not_reused_until_its_hold_settles() -> None:
    # A transfer that gave up waiting (ZMQ kept the payload, Mooncake timed out) may still
    # read this block: it must not be handed to another request before the hold settles.
    engine = RecordingEngine()
    owner, budget = _arena_owner(engine)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        held = owner.stage("a", torch.ones(4096, dtype=torch.uint8), copy=False)
        kept = owner.stage("b", torch.ones(4096, dtype=torch.uint8), copy=False)
        hold = Hold("a test transfer", 4096)
        owner.hold(held, hold)
        assert owner.free("a", held) is None
        assert owner.free("b", kept) is None
        assert owner.arena is not None
        assert owner.arena.allocated == 1
        assert budget.staged_bytes == 4096
        assert owner.held_bytes == 4096
        again = owner.stage("c", torch.ones(4096, dtype=torch.uint8), copy=False)
        assert again.arena_offset != held.arena_offset
        owner.free("c", again)
        hold.settle("the test's transfer ended")
        with anyio.fail_after(5):
            while owner.arena.allocated:
                await anyio.sleep(0.01)
        assert budget.staged_bytes == 0
        assert owner.held_bytes == 0
        owner.stop_accepting()
    assert engine.regions == {}


async def test_an_arena_still_held_at_close_stays_registered_and_alive() -> None:
    engine = RecordingEngine()
    owner, budget = _arena_owner(engine)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        held = owner.stage("a", torch.ones(4096, dtype=torch.uint8), copy=False)
        hold = Hold("a test transfer", 4096)
        owner.hold(held, hold)
        owner.free("a", held)
        assert owner.arena is not None
        buffer = weakref.ref(owner.arena.buffer)
        owner.stop_accepting()
    # Never deregistered nor freed under the transfer: the engine (which cannot say when it
    # is destroyed) keeps the registration, and the buffer with it, for good.
    assert len(engine.regions) == 1
    assert budget.staged_bytes == 4096
    del owner, held
    gc.collect()
    assert buffer() is not None


@pytest.mark.device
async def test_without_an_engine_zmq_pushes_from_an_unregistered_arena(
    make_encoder: MakeEncoder,
) -> None:
    # ZMQ only: the arena is a plain buffer (nothing registers it), each embedding that fits
    # is staged into a block, pushed from there, and the block goes back once delivered.
    # On the tests' device (ENCDISAGG_TEST_DEVICE) the arena lives there too, and each push
    # goes out of a copy to the host.
    from encdisagg import ZmqDestination
    from encdisagg.transfer import ZmqReceiver

    model = DeviceScriptedModel(hidden_size=HIDDEN, dtype=torch.float32)
    async with ZmqReceiver() as receiver, make_encoder(model=model, staging_arena_mb=1) as enc:
        assert enc.stats().registered_regions == 0
        for index, tokens in enumerate((100, 600, 1100)):
            result = await enc.encode(EncodeRequest(f"z{index}", [tokens]))
            # The one bigger than the arena is staged as its own tensor.
            assert arena_blocks(enc) == (0 if tokens == 1100 else 1)
            await enc.send(result.req_id, ZmqDestination(receiver.url))
            with anyio.fail_after(30):
                part = await receiver.receive()
            assert part.tensor is not None
            assert torch.equal(part.tensor, expected(model, tokens).cpu())
            assert arena_blocks(enc) == 0
            stats = enc.stats()
            assert (stats.live_requests, stats.staged_bytes, stats.registered_regions) == (0, 0, 0)
