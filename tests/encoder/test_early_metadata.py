"""Metadata is published once preprocessing knows it, before the forward ends (DESIGN.md
§4.5, ``wait_metadata``), so a receiver can allocate while the model runs."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
import torch

from encdisagg import Encoder, EncodeRequest, EncodeResult

from .fakes import ScriptedModel

pytestmark = pytest.mark.anyio

MakeEncoder = Callable[..., Encoder]

HIDDEN = 12


async def test_metadata_is_ready_while_the_forward_still_runs(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel(hidden_size=HIDDEN, dtype=torch.bfloat16)
    forward_gate, forward_started = model.block_forward()
    encoded: list[EncodeResult] = []
    early: list[EncodeResult] = []
    async with make_encoder(model=model) as encoder:

        async def encode() -> None:
            encoded.append(await encoder.encode(EncodeRequest("r1", [4, 6])))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(encode)
                try:
                    await forward_started.wait()
                    with anyio.move_on_after(5):
                        early.append(await encoder.wait_metadata("r1"))
                    still_running = not encoded
                finally:
                    forward_gate.set()
        await encoder.release("r1")
    assert early, "wait_metadata waited for the forward"
    assert still_running
    (metadata,) = early
    assert metadata.req_id == "r1"
    assert metadata.token_counts == (4, 6)
    assert metadata.grid == ((1, 2, 8), (1, 2, 12))
    assert metadata.num_tokens == 10
    assert metadata.hidden_size == HIDDEN
    assert metadata.dtype == "bfloat16"
    assert metadata.nbytes == 10 * HIDDEN * 2
    # The encode, once done, reports the same numbers.
    assert encoded == [metadata]
