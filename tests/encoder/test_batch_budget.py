"""The queued-input budget: preprocessed bytes waiting for the model bound new encodes (503)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import anyio
import anyio.from_thread
import pytest
from anyio.abc import TaskStatus

from encdisagg import (
    BadRequestError,
    Encoder,
    EncoderConfig,
    EncodeRequest,
    Modality,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from encdisagg.encoder._compute._batcher import Batcher, ForwardJob
from encdisagg.encoder._compute._queued import QueuedInputs, feature_bytes
from encdisagg.encoder._deadlines import DeadlineKeeper
from encdisagg.models import Preprocessed

from .fakes import ScriptedModel

MIB = 1024 * 1024


class HeavyModel(ScriptedModel):
    """A scripted model whose preprocessed inputs weigh ``nbytes`` each; item ``"wait"``
    blocks its preprocessing on :attr:`preprocess_gate` (after saying so)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self._nbytes = nbytes
        self.preprocess_gate = threading.Event()
        self.preprocessing = anyio.Event()

    def preprocess(self, items: Sequence[object], modality: Modality) -> Preprocessed:
        if "wait" in items:
            anyio.from_thread.run_sync(self.preprocessing.set)
            self.preprocess_gate.wait()
            items = [4 if item == "wait" else item for item in items]
        pre = super().preprocess(items, modality)
        pixels = bytearray(self._nbytes)
        return Preprocessed(
            token_counts=pre.token_counts,
            grid=pre.grid,
            features={**pre.features, "pixels": memoryview(pixels)},
            cache_key=pre.cache_key,
        )


@pytest.fixture
def given_back(monkeypatch: pytest.MonkeyPatch) -> anyio.Event:
    """Set once queued-input bytes are given back (the batcher let go of a job)."""
    event = anyio.Event()
    original = QueuedInputs.give_back

    def give_back(self: QueuedInputs, nbytes: int) -> None:
        original(self, nbytes)
        if nbytes:
            event.set()

    monkeypatch.setattr(QueuedInputs, "give_back", give_back)
    return event


def test_feature_bytes_counts_tensors_and_buffers() -> None:
    import torch

    features = {"a": torch.zeros(4, 8), "b": bytearray(10), "c": (1, 2), "d": memoryview(b"12")}
    assert feature_bytes(features) == 4 * 8 * 4 + 2


def test_queued_inputs_decide_synchronously() -> None:
    queued = QueuedInputs(1)
    queued.check_admission("a")
    queued.hold(MIB)
    with pytest.raises(ServiceUnavailableError, match="queued_memory_limit_mb=1"):
        queued.check_admission("b")
    queued.give_back(MIB)
    queued.check_admission("c")
    assert queued.peak_bytes == MIB
    unbounded = QueuedInputs(None)
    unbounded.hold(10**12)
    unbounded.check_admission("d")


def test_config_fields_are_validated() -> None:
    for name in ("max_items_per_request", "max_request_pixels"):
        with pytest.raises(BadRequestError, match=name):
            EncoderConfig(**{name: 0})
    for name in ("max_image_pixels", "queued_memory_limit_mb"):
        with pytest.raises(BadRequestError, match=name):
            EncoderConfig(**{name: 0})
        EncoderConfig(**{name: None})
    assert EncoderConfig().queued_memory_limit_mb == 256


async def _encode_into(
    encoder: Encoder, request: EncodeRequest, outcome: list[object], *, task_status: TaskStatus
) -> None:
    task_status.started()
    try:
        outcome.append(await encoder.encode(request))
    except Exception as exc:
        outcome.append(exc)


@pytest.mark.anyio
async def test_over_the_budget_new_encodes_get_503(make_encoder: Callable[..., Encoder]) -> None:
    model = HeavyModel(2 * MIB)
    gate, started = model.block_forward()
    async with make_encoder(model=model, queued_memory_limit_mb=1) as encoder:
        outcome: list[object] = []
        async with anyio.create_task_group() as group:
            await group.start(_encode_into, encoder, EncodeRequest("a", [4]), outcome)
            await started.wait()  # a's 2 MiB wait in its forward
            with pytest.raises(
                ServiceUnavailableError, match="queued_memory_limit_mb=1"
            ) as refused:
                await encoder.encode(EncodeRequest("b", [4]))
            assert refused.value.req_id == "b"
            gate.set()
        assert outcome[0].num_tokens == 4  # type: ignore[union-attr]
        # a's forward ended: its bytes are back, and a new encode is admitted.
        result = await encoder.encode(EncodeRequest("c", [4]))
        assert result.num_tokens == 4
        await encoder.release("a")
        await encoder.release("c")


@pytest.mark.anyio
async def test_an_admitted_request_waits_for_room_instead_of_failing(
    make_encoder: Callable[..., Encoder],
) -> None:
    """Admitted on arrival (nothing queued yet), b then finds the budget full once its slot
    is free (a finished preprocessing meanwhile): it waits for a's forward to end, then runs.
    Refusing it there would only have its client send the same body again."""
    model = HeavyModel(2 * MIB)
    gate, started = model.block_forward()
    async with make_encoder(model=model, queued_memory_limit_mb=1, preprocess_threads=1) as encoder:
        first: list[object] = []
        second: list[object] = []
        async with anyio.create_task_group() as group:
            await group.start(_encode_into, encoder, EncodeRequest("a", ["wait"]), first)
            await model.preprocessing.wait()  # a holds the only slot
            await group.start(_encode_into, encoder, EncodeRequest("b", [4]), second)
            await anyio.wait_all_tasks_blocked()  # b passed arrival and waits for the slot
            model.preprocess_gate.set()
            await started.wait()  # a's 2 MiB are in its forward
            await anyio.wait_all_tasks_blocked()
            assert second == []  # b holds the slot, waiting for room
            with pytest.raises(ServiceUnavailableError):
                await encoder.encode(EncodeRequest("c", [4]))  # a new arrival is refused
            gate.set()
        assert first[0].num_tokens == 4  # type: ignore[union-attr]
        assert second[0].num_tokens == 4  # type: ignore[union-attr]
        await encoder.release("a")
        await encoder.release("b")


@pytest.mark.anyio
@pytest.mark.virtual_time
async def test_waiting_for_room_is_bounded(make_encoder: Callable[..., Encoder]) -> None:
    model = HeavyModel(2 * MIB)
    gate, started = model.block_forward()
    async with make_encoder(
        model=model, queued_memory_limit_mb=1, preprocess_threads=1, request_timeout_s=30
    ) as encoder:
        first: list[object] = []

        async def finish_a_preprocessing_once_b_waits() -> None:
            await anyio.wait_all_tasks_blocked()
            model.preprocess_gate.set()

        async with anyio.create_task_group() as group:
            await group.start(_encode_into, encoder, EncodeRequest("a", ["wait"]), first)
            await model.preprocessing.wait()
            group.start_soon(finish_a_preprocessing_once_b_waits)
            # b waits for the slot, then for room; a's forward stays blocked meanwhile.
            with pytest.raises(RequestTimeoutError, match="queued_memory_limit_mb for 30"):
                await encoder.encode(EncodeRequest("b", [4]))
            assert started.is_set()
            gate.set()
        await encoder.release("a")


@pytest.mark.anyio
async def test_a_cancelled_encode_holds_its_bytes_until_the_batcher_let_go(
    make_encoder: Callable[..., Encoder], given_back: anyio.Event
) -> None:
    model = HeavyModel(2 * MIB)
    gate, started = model.block_forward()
    async with make_encoder(model=model, queued_memory_limit_mb=1) as encoder:
        with anyio.move_on_after(3600) as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(encoder.encode, EncodeRequest("a", [4]))
                await started.wait()
                group.cancel_scope.cancel()
        assert not scope.cancelled_caught
        # The forward still reads a's inputs: they still count.
        with pytest.raises(ServiceUnavailableError):
            await encoder.encode(EncodeRequest("b", [4]))
        assert not given_back.is_set()
        gate.set()
        await given_back.wait()
        result = await encoder.encode(EncodeRequest("c", [4]))
        assert result.num_tokens == 4
        await encoder.release("c")


@pytest.mark.anyio
async def test_too_many_items_is_a_400_for_any_model(make_encoder: Callable[..., Encoder]) -> None:
    async with make_encoder(max_items_per_request=2) as encoder:
        with pytest.raises(
            BadRequestError, match=r"'x': mm_items has 3 items, more than max_items_per_request"
        ):
            await encoder.encode(EncodeRequest("x", [1, 1, 1]))
        assert encoder.stats().live_requests == 0


@pytest.mark.anyio
async def test_closing_gives_back_the_bytes_of_jobs_still_queued(
    make_encoder: Callable[..., Encoder], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = HeavyModel(MIB)
    gate, started = model.block_forward()
    all_submitted = anyio.Event()
    submits = 0
    submit = Batcher.submit

    async def counted_submit(self: Batcher, job: ForwardJob) -> None:
        nonlocal submits
        await submit(self, job)
        submits += 1
        if submits == 3:
            all_submitted.set()

    run_deadlines = DeadlineKeeper.run

    async def run_deadlines_then_open_the_gate(self: DeadlineKeeper) -> None:
        # Cancelled with the batcher when the encoder closes: only then may the forward end,
        # or the batcher would still run the queued jobs instead of failing them.
        try:
            await run_deadlines(self)
        finally:
            gate.set()

    monkeypatch.setattr(Batcher, "submit", counted_submit)
    monkeypatch.setattr(DeadlineKeeper, "run", run_deadlines_then_open_the_gate)
    async with make_encoder(model=model, max_batch_size=1) as encoder:
        assert encoder._lifecycle is not None
        queued = encoder._lifecycle._compute.queued
        try:
            async with anyio.create_task_group() as group:
                for req_id in ("a", "b", "c"):
                    group.start_soon(encoder.encode, EncodeRequest(req_id, [4]))
                await started.wait()
                await all_submitted.wait()  # one job in the forward, two queued behind it
                group.cancel_scope.cancel()
            # The encodes were cancelled; the batcher still holds their inputs.
            assert queued.held_bytes == 3 * MIB
        except BaseException:
            gate.set()  # the forward's thread is waited for: never leave it blocked
            raise
    assert queued.held_bytes == 0
