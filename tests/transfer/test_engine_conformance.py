"""The same checks against every TransferEngine: in-process loopback and real Mooncake."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from encdisagg import TransferError
from encdisagg.nurseries import run_thread_to_completion
from encdisagg.transfer import (
    LoopbackEngine,
    LoopbackFabric,
    MooncakeEngine,
    TransferEngine,
)

pytestmark = pytest.mark.anyio

Engine = LoopbackEngine | MooncakeEngine


@pytest.fixture(params=["loopback", "mooncake"])
def engines(
    request: pytest.FixtureRequest, mooncake_pair: tuple[MooncakeEngine, MooncakeEngine]
) -> Iterator[tuple[Engine, Engine]]:
    if request.param == "loopback":
        fabric = LoopbackFabric()
        pair: tuple[Engine, Engine] = (LoopbackEngine(fabric), LoopbackEngine(fabric))
    else:
        pair = mooncake_pair
    before = [engine.registered_regions() for engine in pair]
    yield pair
    # Every check cleans up after itself: the Mooncake pair is shared.
    assert [engine.registered_regions() for engine in pair] == before


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


async def test_is_a_transfer_engine(engines: tuple[Engine, Engine]) -> None:
    for engine in engines:
        assert isinstance(engine, TransferEngine)
        assert engine.session_id
    assert engines[0].session_id != engines[1].session_id


async def test_write_lands_byte_exact_in_the_remote_buffer(
    engines: tuple[Engine, Engine],
) -> None:
    sender, receiver = engines
    source = _pattern(1 << 20, seed=1)
    target = torch.zeros(3 << 20, dtype=torch.uint8)
    sender.register(source.data_ptr(), source.numel())
    receiver.register(target.data_ptr(), target.numel())
    try:
        assert sender.registered_regions() >= 1
        # Into the middle of the remote region, from a sub-range of the local one.
        await run_thread_to_completion(
            sender.write,
            receiver.session_id,
            source.data_ptr() + 16,
            target.data_ptr() + (1 << 20),
            (1 << 20) - 16,
        )
    finally:
        sender.deregister(source.data_ptr())
        receiver.deregister(target.data_ptr())
    assert torch.equal(target[(1 << 20) : (2 << 20) - 16], source[16:])
    assert not target[: 1 << 20].any()
    assert not target[(2 << 20) - 16 :].any()


async def test_write_outside_the_remote_region_fails(engines: tuple[Engine, Engine]) -> None:
    sender, receiver = engines
    source = _pattern(8192, seed=2)
    target = torch.zeros(4096, dtype=torch.uint8)
    sender.register(source.data_ptr(), source.numel())
    receiver.register(target.data_ptr(), target.numel())
    try:
        with pytest.raises(TransferError, match=re.escape(receiver.session_id)):
            # One byte past the end of the remote region.
            await run_thread_to_completion(
                sender.write, receiver.session_id, source.data_ptr(), target.data_ptr() + 1, 4096
            )
        with pytest.raises(TransferError, match=re.escape(receiver.session_id)):
            await run_thread_to_completion(
                sender.write, receiver.session_id, source.data_ptr(), target.data_ptr(), 8192
            )
    finally:
        sender.deregister(source.data_ptr())
        receiver.deregister(target.data_ptr())
    assert not target.any()


async def test_write_to_an_unknown_session_fails(engines: tuple[Engine, Engine]) -> None:
    sender, _ = engines
    source = _pattern(64, seed=3)
    sender.register(source.data_ptr(), source.numel())
    try:
        with pytest.raises(TransferError, match=r"to 127\.0\.0\.1:1\b"):
            await run_thread_to_completion(
                sender.write, "127.0.0.1:1", source.data_ptr(), source.data_ptr(), 64
            )
    finally:
        sender.deregister(source.data_ptr())


async def test_write_from_an_unregistered_local_range_fails(
    engines: tuple[Engine, Engine],
) -> None:
    sender, receiver = engines
    source = _pattern(128, seed=4)
    target = torch.zeros(128, dtype=torch.uint8)
    receiver.register(target.data_ptr(), target.numel())
    try:
        with pytest.raises(TransferError, match="local range"):
            await run_thread_to_completion(
                sender.write, receiver.session_id, source.data_ptr(), target.data_ptr(), 128
            )
    finally:
        receiver.deregister(target.data_ptr())
    assert not target.any()


async def test_deregister_unknown_and_twice_fail(engines: tuple[Engine, Engine]) -> None:
    engine, _ = engines
    buffer = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(TransferError, match="not registered"):
        engine.deregister(buffer.data_ptr())
    engine.register(buffer.data_ptr(), 256)
    with pytest.raises(TransferError, match="not registered"):
        # Not the start of the region.
        engine.deregister(buffer.data_ptr() + 8)
    engine.deregister(buffer.data_ptr())
    with pytest.raises(TransferError, match="not registered"):
        engine.deregister(buffer.data_ptr())


async def test_register_rejects_overlaps_and_empty_regions(
    engines: tuple[Engine, Engine],
) -> None:
    engine, _ = engines
    buffer = torch.zeros(1024, dtype=torch.uint8)
    ptr = buffer.data_ptr()
    for nbytes in (0, -1):
        with pytest.raises(TransferError, match="nbytes"):
            engine.register(ptr, nbytes)
    engine.register(ptr + 256, 256)
    try:
        for start, nbytes in [(ptr + 256, 256), (ptr, 257), (ptr + 511, 10), (ptr + 300, 1)]:
            with pytest.raises(TransferError, match="overlaps"):
                engine.register(start, nbytes)
        # Adjacent regions do not overlap.
        engine.register(ptr, 256)
        engine.register(ptr + 512, 512)
        engine.deregister(ptr)
        engine.deregister(ptr + 512)
    finally:
        engine.deregister(ptr + 256)
