"""A randomized storm: many requests, random cancellations, injected engine failures.

The recording engine flags any deregistration while a write reads the region, any write from
unregistered memory, and any registration left behind. The autouse fixture in conftest.py
checks that the Encoder holds nothing afterwards.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from functools import partial

import anyio
import anyio.lowlevel
import pytest

from encdisagg import EncdisaggError, Encoder, EncodeRequest, MooncakeDestination

from .fakes import HIDDEN, RecordingEngine, ScriptedModel

pytestmark = pytest.mark.anyio

REQUESTS = 500


async def test_storm_has_no_violations_and_no_leaks(
    make_encoder: Callable[..., Encoder], anyio_backend: object
) -> None:
    rng = random.Random(20261130)
    engine = RecordingEngine(
        rng=random.Random(7), register_failure_rate=0.1, write_failure_rate=0.1
    )
    outcomes: Counter[str] = Counter()
    returned = 0

    async with make_encoder(model=ScriptedModel(), engine=engine, max_batch_size=8) as encoder:

        async def cancel_after(scope: anyio.CancelScope, checkpoints: int) -> None:
            for _ in range(checkpoints):
                await anyio.lowlevel.checkpoint()
            scope.cancel()

        async def one_request(index: int, tg: anyio.abc.TaskGroup) -> None:
            nonlocal returned
            req_id = f"storm-{index}"
            tokens = rng.randint(1, 16)
            item: object = "bad" if rng.random() < 0.05 else tokens
            destinations = []
            for d in range(rng.randint(1, 3)):
                buffer = engine.add_remote_buffer(tokens * HIDDEN * 2)
                destinations.append(
                    (MooncakeDestination(engine.session_id, buffer.data_ptr(), f"d{d}:1"), buffer)
                )
            scope = anyio.CancelScope()
            if rng.random() < 0.3:
                tg.start_soon(cancel_after, scope, rng.randint(0, 12))
            early_release = rng.random() < 0.1
            try:
                with scope:
                    await encoder.encode(EncodeRequest(req_id, [item]))
                    async with anyio.create_task_group() as sends:
                        for destination, _ in destinations:
                            sends.start_soon(
                                partial(
                                    encoder.send,
                                    req_id,
                                    destination,
                                    receive_count=len(destinations),
                                )
                            )
                        if early_release:
                            sends.start_soon(encoder.release, req_id)
                if scope.cancelled_caught:
                    outcomes["cancelled"] += 1
                else:
                    outcomes["delivered"] += 1
            except* EncdisaggError as group:
                for error in group.exceptions:
                    outcomes[type(error).__name__] += 1
            finally:
                returned += 1
            await encoder.release(req_id)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for index in range(REQUESTS):
                    tg.start_soon(one_request, index, tg)

        stats = encoder.stats()
        assert stats.live_requests == 0
        assert stats.staged_bytes == 0
        assert stats.registered_regions == 0

    assert returned == REQUESTS
    assert engine.violations == []
    assert engine.regions == {}
    # The storm really exercised the failure paths.
    assert outcomes["delivered"] > 0
    assert outcomes["cancelled"] > 0
    assert outcomes["TransferError"] > 0
    print(f"storm outcomes ({anyio_backend}): {dict(outcomes)}")
