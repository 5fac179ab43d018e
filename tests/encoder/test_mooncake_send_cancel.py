"""A cancelled Encoder.send over real Mooncake TCP, whose write the engine submitted and
waits for without a worker thread: the send returns only once Mooncake said the write
ended, and the request's memory is freed only after that."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from encdisagg import Encoder, EncodeRequest, Modality, MooncakeDestination
from encdisagg.transfer import MooncakeEngine
from encdisagg.transfer._mooncake import _waiter as _mooncake_waiter

from .fakes import ScriptedModel

pytestmark = [pytest.mark.anyio, pytest.mark.mooncake]

MakeEncoder = Callable[..., Encoder]
HIDDEN = 1024  # float16: 2 KiB per token


class _SubmitHook:
    """Wraps the sender's pybind engine: runs a hook right after each submit returned and
    records what Mooncake answered for each batch."""

    def __init__(self, real: Any, after_submit: Callable[[], None]) -> None:
        self._real = real
        self._after_submit = after_submit
        self.submitted: list[int] = []
        self.answers: dict[int, list[int]] = {}
        self.freed_while_running: list[int] = []

    def transfer_submit_write(self, target: str, local: int, remote: int, nbytes: int) -> int:
        batch = int(self._real.transfer_submit_write(target, local, remote, nbytes))
        self.submitted.append(batch)
        self._after_submit()
        return batch

    def transfer_check_status(self, batch: int) -> int:
        rc = int(self._real.transfer_check_status(batch))
        self.answers.setdefault(batch, []).append(rc)
        return rc

    def unregister_memory(self, ptr: int) -> int:
        # Deregistering while a submitted write has not been reported ended would free
        # memory Mooncake may still read.
        for batch in self.submitted:
            if self.answers.get(batch, [0])[-1] != _mooncake_waiter.DONE:
                self.freed_while_running.append(batch)
        return int(self._real.unregister_memory(ptr))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


async def test_a_cancelled_send_returns_once_the_write_ended_then_frees(
    make_encoder: MakeEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = 512  # 1 MiB: submitted on the event loop
    target = torch.zeros(tokens * HIDDEN * 2, dtype=torch.uint8)
    send_scope = anyio.CancelScope()

    def cancel_twice() -> None:
        send_scope.cancel()
        send_scope.cancel()

    async with MooncakeEngine() as receiver, MooncakeEngine() as sender:
        receiver.register(target.data_ptr(), target.numel())
        destination = MooncakeDestination(receiver.session_id, target.data_ptr(), "peer:1")
        model = ScriptedModel(hidden_size=HIDDEN)
        async with make_encoder(model=model, engine=sender, transfer="mooncake") as encoder:
            # The first write opens the session (through a worker thread).
            await encoder.encode(EncodeRequest("warm", [tokens]))
            await encoder.send("warm", destination)
            target.zero_()
            hook = _SubmitHook(sender._engine, cancel_twice)
            monkeypatch.setattr(sender, "_engine", hook)

            await encoder.encode(EncodeRequest("cut", [tokens]))
            with send_scope:
                await encoder.send("cut", destination)
                pytest.fail("the send returned normally")
            assert send_scope.cancelled_caught
            (batch,) = hook.submitted
            # Mooncake had said the write was done when the cancelled send returned...
            assert hook.answers[batch][-1] == _mooncake_waiter.DONE
            # ...and the request, released by the cancelled send, freed its memory after.
            with anyio.fail_after(10):
                while encoder.stats().live_requests or encoder.stats().registered_regions:
                    await anyio.sleep(0.01)
            assert hook.freed_while_running == []
            expected = torch.cat(model.forward([model.preprocess([tokens], Modality.IMAGE)]))
            assert torch.equal(target, expected.contiguous().view(torch.uint8).reshape(-1))
        receiver.deregister(target.data_ptr())
