"""LoopbackEngine and LoopbackFabric beyond the shared engine conformance checks."""

from __future__ import annotations

import anyio
import pytest
import torch

from encdisagg import TransferError
from encdisagg.nurseries import run_thread_to_completion
from encdisagg.transfer import LoopbackEngine, LoopbackFabric

pytestmark = pytest.mark.anyio


async def test_an_engine_without_a_fabric_writes_into_its_own_regions() -> None:
    engine = LoopbackEngine()
    source = torch.arange(64, dtype=torch.uint8)
    target = torch.zeros(64, dtype=torch.uint8)
    engine.register(source.data_ptr(), 64)
    engine.register(target.data_ptr(), 64)
    await run_thread_to_completion(
        engine.write, engine.session_id, source.data_ptr(), target.data_ptr(), 64
    )
    assert torch.equal(source, target)
    assert engine.fabric.sessions() == (engine.session_id,)


async def test_fabrics_are_isolated_and_names_unique() -> None:
    fabric, other = LoopbackFabric(), LoopbackFabric()
    first = LoopbackEngine(fabric, name="prefill-0")
    stranger = LoopbackEngine(other, name="prefill-1")
    with pytest.raises(TransferError, match="'prefill-0' already exists"):
        LoopbackEngine(fabric, name="prefill-0")
    with pytest.raises(TransferError, match="name"):
        LoopbackEngine(fabric, name="")
    buffer = torch.zeros(16, dtype=torch.uint8)
    stranger.register(buffer.data_ptr(), 16)
    first.register(buffer.data_ptr(), 16)  # another engine's table: no overlap with it
    with pytest.raises(TransferError, match="write to prefill-1: unknown session"):
        first.write("prefill-1", buffer.data_ptr(), buffer.data_ptr(), 16)
    assert fabric.sessions() == ("prefill-0",)
    assert LoopbackEngine(fabric).session_id not in {"prefill-0", "prefill-1"}


async def test_close_leaves_the_fabric_and_async_with_closes() -> None:
    fabric = LoopbackFabric()
    writer = LoopbackEngine(fabric)
    source = torch.ones(8, dtype=torch.uint8)
    writer.register(source.data_ptr(), 8)
    async with LoopbackEngine(fabric, name="rx") as receiver:
        receiver.register(source.data_ptr(), 8)
        assert receiver.registered_regions() == 1
        assert "rx" in fabric.sessions()
    assert "rx" not in fabric.sessions()
    with pytest.raises(TransferError, match="closed"):
        receiver.register(source.data_ptr(), 8)
    with pytest.raises(TransferError, match="unknown session"):
        writer.write("rx", source.data_ptr(), source.data_ptr(), 8)
    receiver.close()  # idempotent
    # The name is free again.
    LoopbackEngine(fabric, name="rx")


async def test_rejects_bad_arguments_naming_the_call() -> None:
    engine = LoopbackEngine()
    buffer = torch.zeros(8, dtype=torch.uint8)
    engine.register(buffer.data_ptr(), 8)
    with pytest.raises(TransferError, match="loopback register: ptr"):
        engine.register(0, 8)
    with pytest.raises(TransferError, match="nbytes"):
        engine.register(buffer.data_ptr() + 100, True)  # type: ignore[arg-type]
    with pytest.raises(TransferError, match=r"loopback write to .*nbytes"):
        engine.write(engine.session_id, buffer.data_ptr(), buffer.data_ptr(), 0)
    with pytest.raises(TransferError, match="remote_ptr"):
        engine.write(engine.session_id, buffer.data_ptr(), -4, 8)


async def test_concurrent_writes_and_registrations_from_threads() -> None:
    fabric = LoopbackFabric()
    sender, receiver = LoopbackEngine(fabric), LoopbackEngine(fabric)
    chunks, size = 16, 1 << 16
    source = torch.randint(0, 256, (chunks * size,), dtype=torch.uint8)
    target = torch.zeros(chunks * size, dtype=torch.uint8)
    sender.register(source.data_ptr(), source.numel())
    receiver.register(target.data_ptr(), target.numel())
    scratch = [torch.zeros(64, dtype=torch.uint8) for _ in range(chunks)]

    def churn(buffer: torch.Tensor) -> None:
        for _ in range(50):
            sender.register(buffer.data_ptr(), 64)
            sender.deregister(buffer.data_ptr())

    async with anyio.create_task_group() as tg:
        for i in range(chunks):
            offset = i * size
            tg.start_soon(
                run_thread_to_completion,
                sender.write,
                receiver.session_id,
                source.data_ptr() + offset,
                target.data_ptr() + offset,
                size,
            )
            tg.start_soon(run_thread_to_completion, churn, scratch[i])
    assert torch.equal(source, target)
    assert sender.registered_regions() == 1
