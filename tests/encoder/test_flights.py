"""Single-flight: concurrent encodes of one content share one preprocess and one forward.

Every race here is ordered by events: the shared preprocessing (or forward) is held on a
gate until the test saw the joins it waits for (``on_cache("joined")``), never by sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.from_thread
import pytest
import torch

from encdisagg import (
    BadRequestError,
    Encoder,
    EncodeRequest,
    InternalError,
    Modality,
    ZmqDestination,
)
from encdisagg.encoder import EncoderEvents
from encdisagg.encoder._compute._flights import Flight, FlightTable, flight_key
from encdisagg.models import Preprocessed, load_model
from encdisagg.transfer import ZmqReceiver

from .fakes import ScriptedModel
from .test_real_components import png

MakeEncoder = Callable[..., Encoder]


class BytesModel(ScriptedModel):
    """A scripted model whose items arrive as bytes (``b"4"``, ``b"bad"``, ``b"short"``), so
    they carry their content and have a flight key. Counts its preprocessing calls; with
    :attr:`preprocess_gate` set up, each preprocessing says it started, then waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.preprocess_calls = 0
        self.preprocess_gate: threading.Event | None = None
        self.preprocessing = anyio.Event()

    def hold_preprocessing(self) -> threading.Event:
        self.preprocess_gate = threading.Event()
        return self.preprocess_gate

    def preprocess(self, items: Sequence[object], modality: Modality) -> Preprocessed:
        self.preprocess_calls += 1
        if self.preprocess_gate is not None:
            anyio.from_thread.run_sync(self.preprocessing.set)
            self.preprocess_gate.wait()
        decoded: list[object] = []
        for item in items:
            assert isinstance(item, bytes)
            text = item.decode()
            decoded.append(int(text) if text.isdigit() else text)
        return super().preprocess(decoded, modality)


class Joins:
    """Encoder events that count requests joining a shared encode."""

    def __init__(self) -> None:
        self.count = 0
        self._waiting: list[tuple[int, anyio.Event]] = []

    def on_cache(self, what: str) -> None:
        if what == "joined":
            self.count += 1
            for target, event in self._waiting:
                if self.count >= target:
                    event.set()

    async def reach(self, target: int) -> None:
        event = anyio.Event()
        self._waiting.append((target, event))
        if self.count < target:
            await event.wait()


def staged_rows(encoder: Encoder, req_id: str) -> torch.Tensor:
    lifecycle = encoder._lifecycle
    assert lifecycle is not None
    staged = lifecycle.table.lookup(req_id).staged
    assert staged is not None
    return staged.tensor


# -- the decisions, without a loop ---------------------------------------------------------


def test_the_first_request_leads_and_the_rest_join() -> None:
    table = FlightTable()
    first, leads = table.join(("image", "d"), "a")
    second, joins_leads = table.join(("image", "d"), "b")
    other, other_leads = table.join(("image", "e"), "c")
    assert (leads, joins_leads, other_leads) == (True, False, True)
    assert second is first
    assert other is not first
    assert (first.waiters, table.started, table.joined, len(table)) == (2, 2, 1, 2)


def test_only_the_last_waiter_to_leave_unfinished_work_cancels_it() -> None:
    table = FlightTable()
    flight, _ = table.join(("image", "d"), "a")
    table.join(("image", "d"), "b")
    assert table.leave(flight) is False
    assert table.leave(flight) is True, "the last one cancels the work"
    # A request arriving now starts afresh instead of joining cancelled work.
    fresh, leads = table.join(("image", "d"), "c")
    assert leads
    assert fresh is not flight


def test_leaving_finished_work_cancels_nothing_and_later_requests_start_afresh() -> None:
    table = FlightTable()
    flight, _ = table.join(("image", "d"), "a")
    table.finish(flight)
    assert flight.ended
    assert table.leave(flight) is False, "nothing left to cancel"
    assert table.join(("image", "d"), "b")[1] is True


def test_the_first_taker_owns_the_rows_and_later_takers_copy() -> None:
    flight = Flight(("image", "d"), "a")
    flight.rows, flight.pre = torch.zeros(2, 2), Preprocessed(token_counts=(2,), grid=((1, 1, 2),))
    assert flight.outcome("b")[2] is False
    assert flight.outcome("a")[2] is True
    cached = Flight(("image", "d"), "a", cached=True)
    cached.rows, cached.pre = flight.rows, flight.pre
    assert cached.outcome("a")[2] is True, "a cache entry is always copied"


def test_each_waiter_gets_its_own_error_naming_its_own_id() -> None:
    flight = Flight(("image", "d"), "a")
    original = BadRequestError("req_id 'a': preprocessing rejected the input: no", req_id="a")
    flight.error = original
    with pytest.raises(BadRequestError) as leader:
        flight.outcome("a")
    with pytest.raises(BadRequestError, match="req_id 'b': preprocessing rejected") as joiner:
        flight.outcome("b")
    assert leader.value is original
    assert joiner.value is not original
    assert joiner.value.req_id == "b"


def test_only_items_that_carry_their_content_have_a_key() -> None:
    key = flight_key([b"png", "data:image/png;base64,AA=="], "image", max_media_bytes=1024)
    assert key is not None
    assert key[0] == "image"
    assert len(key) == 3
    assert flight_key([b"png"], "video", max_media_bytes=1024) != flight_key(
        [b"png"], "image", max_media_bytes=1024
    )
    assert flight_key([b"png", "/some/file.png"], "image", max_media_bytes=1024) is None
    assert flight_key([b"x" * 2048], "image", max_media_bytes=1024) is None


# -- the Encoder ---------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("prefix_cache_mb", [0, 1])
async def test_sixteen_encodes_of_one_image_preprocess_and_forward_once(
    make_encoder: MakeEncoder, prefix_cache_mb: int
) -> None:
    model, joins = BytesModel(), Joins()
    gate = model.hold_preprocessing()
    ids = [f"r{i}" for i in range(16)]
    results = {}
    encoder = make_encoder(
        model=model, prefix_cache_mb=prefix_cache_mb, events=EncoderEvents(on_cache=joins.on_cache)
    )
    async with encoder:

        async def encode(req_id: str) -> None:
            results[req_id] = await encoder.encode(EncodeRequest(req_id, [b"6"]))

        async with anyio.create_task_group() as group:
            for req_id in ids:
                group.start_soon(encode, req_id)
            await joins.reach(15)
            gate.set()
        assert (model.preprocess_calls, model.forward_batches) == (1, [1])
        assert {result.num_tokens for result in results.values()} == {6}
        rows = [staged_rows(encoder, req_id) for req_id in ids]
        assert all(torch.equal(rows[0], other) for other in rows[1:])
        # Each request stages memory of its own.
        assert len({tensor.data_ptr() for tensor in rows}) == len(ids)
        assert encoder.stats().staged_bytes == 16 * rows[0].numel() * rows[0].element_size()
        for req_id in ids:
            await encoder.release(req_id)


async def _encode_until_cancelled(
    encoder: Encoder,
    req_id: str,
    *,
    task_status: anyio.abc.TaskStatus[tuple[anyio.CancelScope, anyio.Event]],
) -> None:
    left = anyio.Event()
    try:
        with anyio.CancelScope() as scope:
            task_status.started((scope, left))
            await encoder.encode(EncodeRequest(req_id, [b"5"]))
        assert scope.cancelled_caught
    finally:
        left.set()


@pytest.mark.anyio
@pytest.mark.parametrize("cancelled", ["r0", "r1"], ids=["leader", "joiner"])
async def test_a_cancelled_waiter_leaves_the_others_served(
    make_encoder: MakeEncoder, cancelled: str
) -> None:
    model, joins = BytesModel(), Joins()
    gate, forward_started = model.block_forward()
    encoder = make_encoder(model=model, events=EncoderEvents(on_cache=joins.on_cache))
    served: dict[str, int] = {}
    async with encoder:

        async def encode(req_id: str) -> None:
            served[req_id] = (await encoder.encode(EncodeRequest(req_id, [b"5"]))).num_tokens

        async with anyio.create_task_group() as group:
            for req_id in ("r0", "r1", "r2"):
                if req_id == cancelled:
                    scope, left = await group.start(_encode_until_cancelled, encoder, req_id)
                else:
                    group.start_soon(encode, req_id)
                if req_id == "r0":
                    # r0 leads: the shared work is in its forward before anyone joins.
                    await forward_started.wait()
            await joins.reach(2)
            scope.cancel()
            # It leaves while the shared forward is still held.
            await left.wait()
            assert not gate.is_set()
            gate.set()
        assert served == {req_id: 5 for req_id in ("r0", "r1", "r2") if req_id != cancelled}
        assert model.forward_batches == [1]
        assert encoder.stats().live_requests == 2
        for req_id in served:
            await encoder.release(req_id)


@pytest.mark.anyio
async def test_the_last_waiter_to_leave_cancels_the_work_and_waits_for_it(
    make_encoder: MakeEncoder,
) -> None:
    model, joins = BytesModel(), Joins()
    gate = model.hold_preprocessing()
    encoder = make_encoder(model=model, events=EncoderEvents(on_cache=joins.on_cache))
    async with encoder:
        async with anyio.create_task_group() as group:
            first = await group.start(_encode_until_cancelled, encoder, "r0")
            second = await group.start(_encode_until_cancelled, encoder, "r1")
            await joins.reach(1)
            await model.preprocessing.wait()
            first[0].cancel()
            await first[1].wait()
            second[0].cancel()
            # The last one waits until the preprocessing thread it cancelled returned.
            await anyio.wait_all_tasks_blocked()
            assert not second[1].is_set()
            gate.set()
        assert model.forward_batches == [], "cancelled work never reached the forward"
        assert len(encoder._require_open()._compute.shared.table) == 0
        # A later request starts afresh.
        model.preprocess_gate = None
        await encoder.encode(EncodeRequest("r2", [b"5"]))
        assert (model.preprocess_calls, model.forward_batches) == (2, [1])
        await encoder.release("r2")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("item", "error", "message"),
    [
        (b"bad", BadRequestError, "preprocessing rejected the input"),
        (b"short", InternalError, "produced 3 tokens"),
    ],
    ids=["preprocess", "forward"],
)
async def test_a_failure_of_the_shared_work_reaches_every_waiter(
    make_encoder: MakeEncoder, item: bytes, error: type[Exception], message: str
) -> None:
    model, joins = BytesModel(), Joins()
    gate = model.hold_preprocessing()
    encoder = make_encoder(model=model, events=EncoderEvents(on_cache=joins.on_cache))
    raised: dict[str, BaseException] = {}
    async with encoder:

        async def encode(req_id: str) -> None:
            with pytest.raises(error) as caught:
                await encoder.encode(EncodeRequest(req_id, [item]))
            raised[req_id] = caught.value

        async with anyio.create_task_group() as group:
            for req_id in ("r0", "r1", "r2"):
                group.start_soon(encode, req_id)
            await joins.reach(2)
            gate.set()
        assert model.preprocess_calls == 1
        for req_id, exc in raised.items():
            assert message in str(exc)
            assert getattr(exc, "req_id", None) == req_id
            if item == b"bad":
                assert f"req_id {req_id!r}: preprocessing" in str(exc)
        assert len({id(exc) for exc in raised.values()}) == 3, "one exception object per waiter"
        assert encoder.stats().live_requests == 0


@pytest.mark.anyio
async def test_requests_of_other_content_or_without_a_key_are_not_shared(
    make_encoder: MakeEncoder,
) -> None:
    model = ScriptedModel()  # int items name no content: no key
    gate, forward_started = model.block_forward()
    async with make_encoder(model=model) as encoder:
        async with anyio.create_task_group() as group:
            for req_id in ("a", "b"):
                group.start_soon(encoder.encode, EncodeRequest(req_id, [4]))
            await forward_started.wait()
            await anyio.wait_all_tasks_blocked()
            gate.set()
        assert sum(model.forward_batches) == 2
        await encoder.release("a")
        await encoder.release("b")


# -- with the parts a user meets -----------------------------------------------------------


@pytest.mark.anyio
async def test_the_tiny_model_encodes_a_repeated_png_once_for_every_receiver(
    make_encoder: MakeEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model("tiny")
    image = png(56, 56)
    calls = {"preprocess": 0, "forward": 0}
    gate = threading.Event()
    real_preprocess, real_forward = model.preprocess, model.forward

    def preprocess(*args: Any, **kwargs: Any) -> Preprocessed:
        calls["preprocess"] += 1
        gate.wait()
        return real_preprocess(*args, **kwargs)

    def forward(batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        calls["forward"] += 1
        return real_forward(batch)

    monkeypatch.setattr(model, "preprocess", preprocess)
    monkeypatch.setattr(model, "forward", forward)
    joins = Joins()
    ids = ["a", "b", "c", "d"]
    received = {}
    events = EncoderEvents(on_cache=joins.on_cache)
    async with ZmqReceiver() as receiver, make_encoder(model=model, events=events) as encoder:
        async with anyio.create_task_group() as group:
            for req_id in ids:
                group.start_soon(encoder.encode, EncodeRequest(req_id, [image]))
            await joins.reach(len(ids) - 1)
            gate.set()
        assert calls == {"preprocess": 1, "forward": 1}
        for req_id in ids:
            await encoder.send(req_id, ZmqDestination(receiver.url))
            with anyio.fail_after(30):
                part = await receiver.receive()
            assert part.tensor is not None
            received[part.header.req_id] = part.tensor
    assert sorted(received) == ids
    expected = torch.cat(real_forward([real_preprocess([image], Modality.IMAGE)]))
    for tensor in received.values():
        assert torch.equal(tensor, expected)
