"""The request lifecycle of the Encoder, rule by rule (DESIGN.md §6, rules 1-12 and 14)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import anyio
import pytest
import torch

from encdisagg import (
    BadRequestError,
    Encoder,
    EncodeRequest,
    InternalError,
    MooncakeDestination,
    NotFoundError,
    RequestNotActiveError,
    RequestTimeoutError,
    ServiceUnavailableError,
    TransferError,
)

from .fakes import HIDDEN, RecordingEngine, ScriptedModel

pytestmark = pytest.mark.anyio

MakeEncoder = Callable[..., Encoder]


def request(req_id: str = "r1", *items: object, **fields: object) -> EncodeRequest:
    return EncodeRequest(req_id, list(items) or [4], **fields)  # type: ignore[arg-type]


def mooncake_to(
    engine: RecordingEngine, nbytes: int, endpoint: str = "prefill:1"
) -> tuple[MooncakeDestination, torch.Tensor]:
    buffer = engine.add_remote_buffer(nbytes)
    return (
        MooncakeDestination(engine.session_id, buffer.data_ptr(), endpoint),
        buffer,
    )


def live_ids(encoder: Encoder) -> set[str]:
    assert encoder._lifecycle is not None
    return set(encoder._lifecycle.table.live)


def waiting(encoder: Encoder, req_id: str) -> int:
    assert encoder._lifecycle is not None
    return encoder._lifecycle.wakeups.waiting(req_id)


def staged_bytes(tokens: int) -> int:
    return tokens * HIDDEN * 2


async def queued_jobs(encoder: Encoder, count: int) -> None:
    """Wait until ``count`` jobs wait for the (blocked) batcher. Preprocessing runs in
    threads, which wait_all_tasks_blocked cannot see, so poll the queue itself."""
    assert encoder._batcher is not None
    with anyio.fail_after(10):
        while encoder._batcher._receive.statistics().current_buffer_used < count:
            await anyio.sleep(0.001)


# -- basics -------------------------------------------------------------------------------


async def test_encode_reports_the_staged_embedding(make_encoder: MakeEncoder) -> None:
    async with make_encoder() as encoder:
        result = await encoder.encode(request("r1", 4, 6))
        assert result.req_id == "r1"
        assert result.num_tokens == 10
        assert result.hidden_size == HIDDEN
        assert result.dtype == "float16"
        assert result.nbytes == staged_bytes(10)
        assert result.token_counts == (4, 6)
        assert result.grid == ((1, 2, 8), (1, 2, 12))
        stats = encoder.stats()
        assert stats.live_requests == 1
        assert stats.staged_bytes == staged_bytes(10)
        assert await encoder.wait_metadata("r1") == result
        await encoder.release("r1")
        assert encoder.stats().live_requests == 0


async def test_a_live_id_cannot_be_encoded_twice(make_encoder: MakeEncoder) -> None:
    async with make_encoder() as encoder:
        await encoder.encode(request("dup"))
        with pytest.raises(RequestNotActiveError, match="dup"):
            await encoder.encode(request("dup"))
        await encoder.release("dup")


async def test_bad_input_and_internal_errors_map_to_the_hierarchy(
    make_encoder: MakeEncoder,
) -> None:
    async with make_encoder() as encoder:
        with pytest.raises(BadRequestError, match=r"mm_items\[1\]") as bad:
            await encoder.encode(request("b", 4, "bad"))
        assert bad.value.status == 400
        with pytest.raises(InternalError, match="processor exploded"):
            await encoder.encode(request("c", "crash"))
        with pytest.raises(
            InternalError, match="Encoder produced 3 tokens, but preprocessor metadata expected 4"
        ):
            await encoder.encode(request("s", "short"))


async def test_send_unknown_id_is_not_found(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine()
    async with make_encoder(engine=engine) as encoder:
        destination, _ = mooncake_to(engine, 64)
        with pytest.raises(NotFoundError, match="nope"):
            await encoder.send("nope", destination)


async def test_mooncake_send_delivers_bytes_and_frees_once(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine()
    async with make_encoder(engine=engine) as encoder:
        result = await encoder.encode(request("r1", 5))
        assert encoder.stats().registered_regions == 1
        destination, buffer = mooncake_to(engine, result.nbytes)
        await encoder.send("r1", destination)
        # default_receive_count = 1: the request is gone.
        assert encoder.stats().live_requests == 0
        assert engine.registrations == 1
        assert engine.deregistrations == 1
        received = buffer.view(torch.float16).reshape(5, HIDDEN)
        expected = ScriptedModel().forward([ScriptedModel().preprocess([5], request().kind)])[0]
        assert torch.equal(received, expected)
        with pytest.raises(RequestNotActiveError):
            await encoder.send("r1", destination)


# -- rule 1: a cancelled transfer returns only after it stopped touching memory --------------


async def test_cancelled_send_returns_after_the_write_stopped(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine()
    engine.write_gate = threading.Event()
    engine.write_started = anyio.Event()
    order: list[str] = []
    async with make_encoder(engine=engine) as encoder:
        result = await encoder.encode(request("r1"))
        destination, _ = mooncake_to(engine, result.nbytes)

        async def sender(scope: anyio.CancelScope) -> None:
            with scope:
                await encoder.send("r1", destination)
            order.append("send returned")

        scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender, scope)
            await engine.write_started.wait()
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert order == []
            assert engine.regions  # still registered: the write still reads it
            engine.write_gate.set()
        order.append("after")
        assert scope.cancelled_caught
    # The deregistration came after the write ended, never during it.
    kinds = [entry.rsplit(" ", 1)[0] for entry in engine.log]
    assert kinds == ["register", "write start", "write end", "deregister"]


# -- rule 2: every registration is deregistered exactly once, after the transfers ----------


async def test_failed_write_releases_and_deregisters_once(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine(write_failure_rate=1.0)
    async with make_encoder(engine=engine) as encoder:
        result = await encoder.encode(request("r1"))
        destination, _ = mooncake_to(engine, result.nbytes)
        with pytest.raises(TransferError, match="injected write failure"):
            await encoder.send("r1", destination)
        assert encoder.stats().live_requests == 0
        assert engine.registrations == engine.deregistrations == 1


# -- rule 3: a failed shared registration falls back to registering per send --------------


async def test_shared_registration_failure_falls_back_per_send(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine(register_failure_rate=1.0)
    async with make_encoder(engine=engine, default_receive_count=2) as encoder:
        result = await encoder.encode(request("r1"))
        assert encoder.stats().registered_regions == 0
        engine.register_failure_rate = 0.0
        first, buffer_a = mooncake_to(engine, result.nbytes, "a:1")
        second, buffer_b = mooncake_to(engine, result.nbytes, "b:1")
        await encoder.send("r1", first)
        await encoder.send("r1", second)
        assert torch.equal(buffer_a, buffer_b)
        assert engine.registrations == engine.deregistrations == 2


async def test_failed_fallback_write_still_deregisters(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine(register_failure_rate=1.0)
    async with make_encoder(engine=engine) as encoder:
        result = await encoder.encode(request("r1"))
        engine.register_failure_rate = 0.0
        engine.write_failure_rate = 1.0
        destination, _ = mooncake_to(engine, result.nbytes)
        with pytest.raises(TransferError):
            await encoder.send("r1", destination)
        assert engine.registrations == engine.deregistrations == 1


# -- rule 4: release during encode is deferred; abandon before encode applies on create ----


async def test_release_during_encode_is_deferred_to_its_end(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    gate, started = model.block_forward()
    engine = RecordingEngine()
    async with make_encoder(model=model, engine=engine) as encoder:
        results = []

        async def encode() -> None:
            results.append(await encoder.encode(request("r1")))

        async with anyio.create_task_group() as tg:
            tg.start_soon(encode)
            await started.wait()
            with anyio.fail_after(5):
                await encoder.release("r1")  # returns at once, the encode is in flight
            assert encoder.stats().live_requests == 1
            gate.set()
        assert results[0].num_tokens == 4
        assert encoder.stats().live_requests == 0
        destination, _ = mooncake_to(engine, 64)
        with pytest.raises(RequestNotActiveError):
            await encoder.send("r1", destination)
        # Not resurrected: a fresh lifecycle for the same id works.
        model.gate = None
        await encoder.encode(request("r1"))
        await encoder.release("r1")


async def test_abandon_before_encode_applies_when_created(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    async with make_encoder(model=model) as encoder:
        await encoder.abandon("later")
        with pytest.raises(RequestNotActiveError, match="abandoned"):
            await encoder.encode(request("later"))
        assert model.forward_batches == []
        # The tombstone was consumed: the id can be used again.
        await encoder.encode(request("later"))
        await encoder.abandon("later")  # live: a plain release
        assert encoder.stats().live_requests == 0


# -- rule 5: no new work once release began; a reused id starts afresh ---------------------


async def test_no_send_or_registration_after_release_began(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine()
    engine.write_gate = threading.Event()
    engine.write_started = anyio.Event()
    async with make_encoder(engine=engine, default_receive_count=3) as encoder:
        result = await encoder.encode(request("r1"))
        first, _ = mooncake_to(engine, result.nbytes, "a:1")
        second, _ = mooncake_to(engine, result.nbytes, "b:1")
        async with anyio.create_task_group() as tg:
            tg.start_soon(encoder.send, "r1", first)
            await engine.write_started.wait()
            tg.start_soon(encoder.release, "r1")
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(RequestNotActiveError):
                await encoder.send("r1", second)
            with pytest.raises(RequestNotActiveError):
                await encoder.register_destinations("r1", 3, ["tcp://127.0.0.1:1"])
            engine.write_gate.set()
        assert encoder.stats().live_requests == 0


# -- rule 6: release waits for sends, then frees, and wakes waiters ------------------------


async def test_release_waits_for_the_send_then_frees(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine()
    engine.write_gate = threading.Event()
    engine.write_started = anyio.Event()
    async with make_encoder(engine=engine, default_receive_count=2) as encoder:
        result = await encoder.encode(request("r1"))
        destination, _ = mooncake_to(engine, result.nbytes)
        released = anyio.Event()

        async def release() -> None:
            await encoder.release("r1")
            released.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(encoder.send, "r1", destination)
            await engine.write_started.wait()
            tg.start_soon(release)
            await anyio.wait_all_tasks_blocked()
            assert not released.is_set()
            assert encoder.stats().staged_bytes == result.nbytes
            engine.write_gate.set()
            await released.wait()
            assert encoder.stats().staged_bytes == 0


async def test_release_wakes_metadata_waiters_of_a_failed_encode(make_encoder: MakeEncoder) -> None:
    async with make_encoder() as encoder:
        with pytest.raises(BadRequestError):
            await encoder.encode(request("r1", "bad"))
        # rule 11: error metadata outlives the freed buffers.
        assert encoder.stats().live_requests == 0
        with pytest.raises(BadRequestError, match="cannot decode"):
            await encoder.wait_metadata("r1")


async def test_a_failing_error_publish_keeps_the_original_error(
    make_encoder: MakeEncoder,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with make_encoder() as encoder:
        assert encoder._lifecycle is not None
        lifecycle = encoder._lifecycle
        wake = lifecycle.wakeups.wake

        def broken_wake(key: str, *, removed: bool = False) -> None:
            record = lifecycle.table.get(key)
            if record is not None and record.error is not None:
                raise RuntimeError("metadata store is down")
            wake(key, removed=removed)

        monkeypatch.setattr(lifecycle.wakeups, "wake", broken_wake)
        with (
            caplog.at_level(logging.ERROR, logger="encdisagg.encoder"),
            pytest.raises(BadRequestError, match="cannot decode"),
        ):
            await encoder.encode(request("r1", "bad"))
        assert "publishing the error of req_id 'r1' failed" in caplog.text
        # Still released.
        assert encoder.stats().live_requests == 0


# -- rule 7: freed only after n distinct destinations; retries count once ------------------


async def test_receive_count_counts_distinct_destinations(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine()
    async with make_encoder(engine=engine) as encoder:
        result = await encoder.encode(request("r1"))
        a, _ = mooncake_to(engine, result.nbytes, "10.0.0.1:5000")
        b, _ = mooncake_to(engine, result.nbytes, "10.0.0.2:5000")
        await encoder.send("r1", a, receive_count=2)
        await encoder.send("r1", a)  # a retry from the same destination
        assert encoder.stats().live_requests == 1
        await encoder.send("r1", b)
        assert encoder.stats().live_requests == 0


# -- rule 8: every staged request is eventually freed by its own deadline ------------------


@pytest.mark.virtual_time
async def test_unsent_request_is_freed_by_its_deadline(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine()
    async with make_encoder(engine=engine, send_timeout_s=180) as encoder:
        await encoder.encode(request("stale"))
        await anyio.sleep(179)
        assert encoder.stats().live_requests == 1
        await anyio.sleep(2)
        assert encoder.stats().live_requests == 0
        with pytest.raises(RequestNotActiveError):
            await encoder.wait_metadata("stale")


@pytest.mark.virtual_time
async def test_stale_requests_do_not_block_each_other(make_encoder: MakeEncoder) -> None:
    engine = RecordingEngine()
    engine.write_gate = threading.Event()
    engine.write_started = anyio.Event()
    async with make_encoder(engine=engine, send_timeout_s=60) as encoder:
        result = await encoder.encode(request("pinned"))
        destination, _ = mooncake_to(engine, result.nbytes)

        async def pinned_send() -> None:
            with pytest.raises(RequestTimeoutError, match="send_timeout_s"):
                await encoder.send("pinned", destination)

        async with anyio.create_task_group() as tg:
            tg.start_soon(pinned_send)
            await engine.write_started.wait()
            await encoder.encode(request("other"))
            # A pinned transfer does not hold up the other request's expiry.
            await anyio.sleep(59)
            assert "other" in live_ids(encoder)
            await anyio.sleep(2)
            assert "other" not in live_ids(encoder)
            assert "pinned" in live_ids(encoder)
            engine.write_gate.set()


@pytest.mark.virtual_time
async def test_failed_deregistration_is_retried_keeping_the_memory(
    make_encoder: MakeEncoder, caplog: pytest.LogCaptureFixture
) -> None:
    engine = RecordingEngine(deregister_failures=2)
    async with make_encoder(engine=engine) as encoder:
        result = await encoder.encode(request("r1"))
        with caplog.at_level(logging.ERROR, logger="encdisagg.encoder"):
            await encoder.release("r1")
        stats = encoder.stats()
        assert stats.live_requests == 0
        # Still registered, so its memory is still held (never freed under the engine).
        assert stats.registered_regions == 1
        assert stats.staged_bytes == result.nbytes
        assert "deregistering its staged embedding failed" in caplog.text
        # Retries back off 1 s, then 2 s: the second retry succeeds.
        await anyio.sleep(4)
        assert encoder.stats().registered_regions == 0
        assert encoder.stats().staged_bytes == 0
        assert engine.deregistrations == 1


# -- rule 9: bounded waits create no state -------------------------------------------------


@pytest.mark.virtual_time
async def test_destination_registration_times_out_without_state(make_encoder: MakeEncoder) -> None:
    async with make_encoder(request_timeout_s=30) as encoder:
        with pytest.raises(RequestTimeoutError, match="ghost"):
            await encoder.register_destinations("ghost", 1, ["tcp://127.0.0.1:9"])
        with pytest.raises(RequestTimeoutError, match="ghost"):
            await encoder.wait_metadata("ghost")
        assert waiting(encoder, "ghost") == 0
        assert encoder.stats().live_requests == 0


async def test_cancelled_waits_leave_no_state(make_encoder: MakeEncoder) -> None:
    async with make_encoder() as encoder:
        async with anyio.create_task_group() as tg:
            tg.start_soon(encoder.register_destinations, "ghost", 1, ["tcp://127.0.0.1:9"])
            tg.start_soon(encoder.wait_metadata, "ghost")
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
        assert waiting(encoder, "ghost") == 0
        assert encoder.stats().live_requests == 0


async def test_registration_before_encode_meets_it(make_encoder: MakeEncoder) -> None:
    # Nobody listens at the URL: the error part's push fails fast and is logged.
    async with make_encoder(zmq_send_timeout_s=0.2) as encoder:
        async with anyio.create_task_group() as tg:
            tg.start_soon(encoder.register_destinations, "r1", 2, ["tcp://127.0.0.1:9"])
            await anyio.wait_all_tasks_blocked()
            assert waiting(encoder, "r1") == 1

            async def encode() -> None:
                with pytest.raises(BadRequestError):
                    await encoder.encode(request("r1", "bad"))

            tg.start_soon(encode)
        with pytest.raises(BadRequestError, match="receive_count"):
            await encoder.register_destinations("r1", 0, ["tcp://127.0.0.1:9"])


# -- rule 10: invalid embeddings never cached; invalid cached entries evicted --------------


async def test_valid_embedding_is_cached_and_reused(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    async with make_encoder(model=model, prefix_cache_mb=1) as encoder:
        await encoder.encode(request("a", 4))
        await encoder.encode(request("b", 4))
        assert model.forward_batches == [1]
        assert encoder.stats().cache_entries == 1
        await encoder.release("a")
        await encoder.release("b")


async def test_invalid_fresh_embedding_is_not_cached(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    async with make_encoder(model=model, prefix_cache_mb=1) as encoder:
        with pytest.raises(InternalError):
            await encoder.encode(request("a", "short"))
        assert encoder.stats().cache_entries == 0


async def test_invalid_cached_embedding_is_evicted_and_fails(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    async with make_encoder(model=model, prefix_cache_mb=1) as encoder:
        await encoder.encode(request("a", 4))
        await encoder.release("a")
        # Corrupt the entry behind the cache's back.
        key = next(iter(encoder.cache._entries))
        encoder.cache._entries[key] = torch.zeros(3, HIDDEN, dtype=torch.float16)
        with pytest.raises(InternalError, match="evicted"):
            await encoder.encode(request("b", 4))
        assert encoder.stats().cache_entries == 0
        await encoder.encode(request("c", 4))
        assert model.forward_batches == [1, 1]
        await encoder.release("c")


# -- rule 12: background failures are observed ---------------------------------------------


async def test_push_failure_is_logged_and_releases(
    make_encoder: MakeEncoder, caplog: pytest.LogCaptureFixture
) -> None:
    async with make_encoder(zmq_send_timeout_s=0.2) as encoder:
        with caplog.at_level(logging.ERROR, logger="encdisagg.encoder"):
            async with anyio.create_task_group() as tg:
                # Nobody listens there: the push times out in the background.
                tg.start_soon(encoder.register_destinations, "r1", 1, ["tcp://127.0.0.1:9"])
                await anyio.wait_all_tasks_blocked()
                await encoder.encode(request("r1"))
            with anyio.fail_after(10):
                while encoder.stats().live_requests:
                    await anyio.sleep(0.05)
    assert "pushing to tcp://127.0.0.1:9 failed" in caplog.text


# -- rule 14: sends only after the encode completed; errors are not hidden ----------------


async def test_send_waits_for_the_encode_then_delivers(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    gate, started = model.block_forward()
    engine = RecordingEngine()
    async with make_encoder(model=model, engine=engine) as encoder:
        destination, buffer = mooncake_to(engine, staged_bytes(4))
        async with anyio.create_task_group() as tg:
            tg.start_soon(encoder.encode, request("r1"))
            await started.wait()
            tg.start_soon(encoder.send, "r1", destination)
            await anyio.wait_all_tasks_blocked()
            assert engine.writes == 0
            gate.set()
        assert engine.writes == 1
        assert buffer.any()


async def test_send_to_a_failed_encode_raises_its_error(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    gate, started = model.block_forward()
    engine = RecordingEngine()
    async with make_encoder(model=model, engine=engine) as encoder:
        destination, _ = mooncake_to(engine, 64)

        async def encode() -> None:
            with pytest.raises(InternalError):
                await encoder.encode(request("r1", "short"))

        async def send() -> None:
            with pytest.raises(InternalError, match="Encoder produced 3 tokens"):
                await encoder.send("r1", destination)

        async with anyio.create_task_group() as tg:
            tg.start_soon(encode)
            await started.wait()
            tg.start_soon(send)
            await anyio.wait_all_tasks_blocked()
            gate.set()
        assert engine.writes == 0


# -- cancellation of encode callers -------------------------------------------------------


async def test_cancelled_encode_stages_nothing(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    gate, started = model.block_forward()
    async with make_encoder(model=model) as encoder:
        async with anyio.create_task_group() as tg:
            tg.start_soon(encoder.encode, request("r1"))
            await started.wait()
            tg.cancel_scope.cancel()
            gate.set()
        await anyio.wait_all_tasks_blocked()
        assert encoder.stats().live_requests == 0
        assert encoder.stats().staged_bytes == 0


# -- batching and admission ----------------------------------------------------------------


async def test_concurrent_requests_are_batched(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    gate, started = model.block_forward()
    async with make_encoder(model=model, max_batch_size=4) as encoder:
        async with anyio.create_task_group() as tg:
            tg.start_soon(encoder.encode, request("first"))
            await started.wait()
            for index in range(6):
                tg.start_soon(encoder.encode, request(f"r{index}", index + 1))
            await queued_jobs(encoder, 6)
            gate.set()
        assert model.forward_batches == [1, 4, 2]
        for req_id in ["first", *(f"r{i}" for i in range(6))]:
            await encoder.release(req_id)


async def test_one_bad_request_does_not_fail_its_batch_mates(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    gate, started = model.block_forward()
    outcomes: dict[str, str] = {}
    async with make_encoder(model=model) as encoder:

        async def encode(req_id: str, item: object) -> None:
            try:
                await encoder.encode(request(req_id, item))
                outcomes[req_id] = "ok"
            except InternalError:
                outcomes[req_id] = "internal"

        async with anyio.create_task_group() as tg:
            tg.start_soon(encode, "first", 2)
            await started.wait()
            tg.start_soon(encode, "good", 3)
            tg.start_soon(encode, "short", "short")
            tg.start_soon(encode, "poison", "poison")
            tg.start_soon(encode, "also-good", 5)
            await queued_jobs(encoder, 4)
            gate.set()
        assert outcomes == {
            "first": "ok",
            "good": "ok",
            "short": "internal",
            "poison": "ok",
            "also-good": "ok",
        }
        # The fused batch of four failed on "poison" and was retried one by one.
        assert model.forward_batches == [1, 4, 1, 1, 1, 1]
        for req_id in ("first", "good", "poison", "also-good"):
            await encoder.release(req_id)


async def test_staged_memory_limit_rejects_with_503(make_encoder: MakeEncoder) -> None:
    async with make_encoder(staged_memory_limit_mb=1) as encoder:
        tokens = (1024 * 1024) // (HIDDEN * 2)
        await encoder.encode(request("big", tokens))
        with pytest.raises(ServiceUnavailableError) as caught:
            await encoder.encode(request("more", 4))
        assert caught.value.status == 503
        await encoder.release("big")
        await encoder.encode(request("more", 4))
        await encoder.release("more")


async def test_closed_encoder_refuses_work(make_encoder: MakeEncoder) -> None:
    encoder = make_encoder()
    with pytest.raises(ServiceUnavailableError):
        await encoder.encode(request())
    async with encoder:
        await encoder.encode(request("left-live"))
    # Leaving the block released it.
    assert encoder.stats().live_requests == 0
    with pytest.raises(ServiceUnavailableError):
        await encoder.encode(request())
