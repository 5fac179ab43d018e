"""The prefill and decode workers over real Loopback engines: parity, aborts that arrive
mid-write, lost drained-acks, corruption in flight, failures upstream."""

from __future__ import annotations

import anyio
import pytest

from encdisagg.pipeline import (
    DecodePhase,
    DecodeStatus,
    DecodeWorker,
    DrainedAck,
    LanguageModel,
    PipelineRequest,
    PrefillReport,
    PrefillStatus,
)
from encdisagg.pipeline._pd_messages import DecodeMessage
from encdisagg.transfer import HoldPolicy, LoopbackEngine

from .conftest import Wiring, wait_for, wired

pytestmark = pytest.mark.anyio

#: 44 prompt tokens: three 16-token KV pages.
PROMPT = "Tell me a story about a tiny language model."


def request(
    rid: str = "r", room: int = 1, *, images: tuple[str, ...] = (), tokens: int = 6
) -> PipelineRequest:
    return PipelineRequest(rid, room, PROMPT, images, tokens)


async def test_a_text_request_matches_the_colocated_model(reference_lm: LanguageModel) -> None:
    async with wired(reference_lm) as w:
        handle = w.decode.admit("r", 1, max_new_tokens=6)
        report = await w.prefill.prefill(request())
        result = await handle.wait()
    assert report.status is PrefillStatus.DONE
    assert report.seq_len == len(PROMPT) + 1
    assert result.status is DecodeStatus.COMPLETED
    assert list(result.tokens) == reference_lm.generate_colocated(PROMPT, [], max_new_tokens=6)
    assert result.checksum == report.checksum != 0
    assert w.engine.writes == 3 + 2  # three pages, then the row's body and its tag


async def test_an_abort_mid_write_holds_the_pages_until_prefill_acks_the_drain(
    reference_lm: LanguageModel,
) -> None:
    async with wired(reference_lm) as w:
        w.engine.gate.clear()
        handle = w.decode.admit("r", 1, max_new_tokens=6)
        reports: list[PrefillReport] = []
        async with anyio.create_task_group() as group:

            async def run() -> None:
                reports.append(await w.prefill.prefill(request()))

            group.start_soon(run)
            await wait_for(w.engine.waiting)  # the first page write is in flight
            w.decode.abort("r")
            result = await handle.wait()
            assert result.status is DecodeStatus.ABORTED
            stats = w.decode.stats()
            # Aborted, yet its pages and slot stay taken: a write may still land.
            assert stats.held == 1
            assert stats.pages_free == stats.pages_total - 3
            assert stats.slots_free == stats.slots_total - 1
            w.engine.gate.set()
        assert reports[0].status is PrefillStatus.ABORTED
        # The writer stopped between pages, and only then acked.
        assert w.engine.writes == 1
        prefill_stats = w.prefill.stats()
        assert (prefill_stats.writes_stopped, prefill_stats.acks_sent) == (1, 1)
        with anyio.fail_after(10):
            await w.decode.wait_idle()
        stats = w.decode.stats()
        assert (stats.held_releases, stats.drained_releases, stats.timed_out_releases) == (1, 1, 0)
        assert stats.pages_free == stats.pages_total


async def abort_mid_write_losing_the_ack(w: Wiring) -> tuple[float, list[DrainedAck]]:
    """Abort ``r`` while its first page write is in flight; prefill's drained-ack is lost
    on its way (returned, for a test to deliver late). Returns when the abort was sent."""
    lost: list[DrainedAck] = []

    def drop_acks(message: DecodeMessage) -> bool:
        if isinstance(message, DrainedAck):
            lost.append(message)
            return False
        return True

    w.to_decode = drop_acks
    w.engine.gate.clear()
    handle = w.decode.admit("r", 1, max_new_tokens=6)
    async with anyio.create_task_group() as group:
        group.start_soon(w.prefill.prefill, request())
        await wait_for(w.engine.waiting)
        w.decode.abort("r")
        aborted_at = anyio.current_time()
        assert (await handle.wait()).status is DecodeStatus.ABORTED
        w.engine.gate.set()
    assert w.prefill.acks_sent == 1  # it was sent; the test lost it
    return aborted_at, lost


@pytest.mark.virtual_time
async def test_without_the_drained_ack_reused_pages_come_back_at_the_timeout(
    reference_lm: LanguageModel,
) -> None:
    async with wired(
        reference_lm, release_timeout_s=30.0, on_release_timeout=HoldPolicy.REUSE
    ) as w:
        aborted_at, _ = await abort_mid_write_losing_the_ack(w)
        with anyio.fail_after(60):
            await w.decode.wait_idle()
        assert anyio.current_time() - aborted_at == pytest.approx(30.0, abs=1.0)
        stats = w.decode.stats()
        assert (stats.drained_releases, stats.timed_out_releases) == (0, 1)
        assert (stats.retired, stats.retired_pages, stats.retirements) == (0, 0, 0)
        assert stats.pages_free == stats.pages_total
        assert stats.slots_free == stats.slots_total
        assert stats.leaked_pages == 0


@pytest.mark.virtual_time
async def test_without_the_drained_ack_the_pages_are_retired_not_leaked(
    reference_lm: LanguageModel,
) -> None:
    async with wired(reference_lm, release_timeout_s=30.0) as w:
        assert w.decode.on_release_timeout is HoldPolicy.RETIRE
        aborted_at, lost = await abort_mid_write_losing_the_ack(w)
        with anyio.fail_after(60):
            await w.decode.wait_idle()
        assert anyio.current_time() - aborted_at == pytest.approx(30.0, abs=1.0)
        stats = w.decode.stats()
        assert (stats.held, stats.retired, stats.retired_pages, stats.retirements) == (0, 1, 3, 1)
        assert (stats.drained_releases, stats.timed_out_releases) == (0, 0)
        # Out of use, yet owned: not counted as leaked.
        assert stats.pages_free == stats.pages_total - 3
        assert stats.slots_free == stats.slots_total - 1
        assert stats.leaked_pages == 0
        assert stats.held_bytes == 3 * w.decode.page_bytes
        # Much later, still retired: no bound gives it back.
        await anyio.sleep(3600)
        assert w.decode.stats().retired_pages == 3
        # The lost ack turns up at last: proof, so the pages come back.
        (ack,) = lost
        w.decode.deliver(ack)
        with anyio.fail_after(5):
            while w.decode.stats().retired:
                await anyio.sleep(0.01)
        stats = w.decode.stats()
        assert (stats.retired, stats.retired_pages, stats.drained_releases) == (0, 0, 1)
        assert stats.pages_free == stats.pages_total
        assert stats.slots_free == stats.slots_total
        assert stats.held_bytes == 0


@pytest.mark.virtual_time
async def test_retired_pages_at_close_stay_registered_with_the_engine(
    reference_lm: LanguageModel,
) -> None:
    async with wired(reference_lm, release_timeout_s=30.0) as w:
        await abort_mid_write_losing_the_ack(w)
        with anyio.fail_after(60):
            await w.decode.wait_idle()
        assert w.decode.stats().retired == 1
        closing_at = anyio.current_time()
    # Closing did not wait for a proof that cannot come any more, and left the pool and the
    # table registered with their engine until it closed (the fixture checked both) rather
    # than deregistering and freeing them.
    assert anyio.current_time() - closing_at < 1.0
    stats = w.decode.stats()
    assert (stats.retired, stats.retired_pages, stats.leaked_pages) == (1, 3, 0)


async def test_the_timeout_policy_is_retire_unless_told_and_checked_by_name(
    reference_lm: LanguageModel,
) -> None:
    engine = LoopbackEngine(name="decode")
    worker = DecodeWorker(reference_lm, engine=engine)
    assert worker.on_release_timeout is HoldPolicy.RETIRE
    assert worker.transfer.on_timeout is HoldPolicy.RETIRE
    reusing = DecodeWorker(reference_lm, engine=engine, on_release_timeout="reuse")
    assert reusing.transfer.on_timeout is HoldPolicy.REUSE
    with pytest.raises(ValueError, match="on_release_timeout must be one of"):
        DecodeWorker(reference_lm, engine=engine, on_release_timeout="forget")
    engine.close()


async def test_kv_corrupted_in_flight_is_caught_by_the_checksum(
    reference_lm: LanguageModel,
) -> None:
    async with wired(reference_lm) as w:
        w.engine.corrupt_size = w.decode.page_bytes
        handle = w.decode.admit("r", 1, max_new_tokens=6)
        report = await w.prefill.prefill(request())
        result = await handle.wait()
        assert report.status is PrefillStatus.DONE
        assert result.status is DecodeStatus.FAILED
        assert "not its own" in result.error
        assert w.decode.stats().corrupt == 1


async def test_an_encoder_failure_fails_the_request_on_both_sides(
    reference_lm: LanguageModel,
) -> None:
    async with wired(reference_lm, encoder_urls=("http://127.0.0.1:9",)) as w:
        handle = w.decode.admit("r", 1, max_new_tokens=6)
        report = await w.prefill.prefill(request(images=("data:image/png;base64,AAAA",)))
        result = await handle.wait()
    assert report.status is PrefillStatus.FAILED
    assert "encoder http://127.0.0.1:9 could not be reached" in report.error
    assert result.status is DecodeStatus.FAILED
    assert result.error == report.error


async def test_an_abort_before_prefill_starts_is_remembered(reference_lm: LanguageModel) -> None:
    async with wired(reference_lm) as w:
        handle = w.decode.admit("r", 1, max_new_tokens=6)
        w.decode.abort("r")
        assert (await handle.wait()).status is DecodeStatus.ABORTED
        report = await w.prefill.prefill(request())
        assert report.status is PrefillStatus.ABORTED
        assert w.engine.writes == 0


async def test_an_abort_while_decoding_stops_between_tokens(reference_lm: LanguageModel) -> None:
    async with wired(reference_lm) as w:
        # 64 pages of 16 tokens hold the prompt's 45 and 900 more: admitted, not finished.
        handle = w.decode.admit("r", 1, max_new_tokens=900)
        async with anyio.create_task_group() as group:
            group.start_soon(w.prefill.prefill, request(tokens=900))
            assert await w.decode.wait_phase("r", DecodePhase.DECODING) is DecodePhase.DECODING
            w.decode.abort("r")
            result = await handle.wait()
        assert result.status is DecodeStatus.ABORTED
        assert 1 <= len(result.tokens) < 900


async def test_a_prompt_larger_than_the_pages_fails_cleanly(reference_lm: LanguageModel) -> None:
    async with wired(reference_lm) as w:
        handle = w.decode.admit("r", 1, max_new_tokens=6)
        report = await w.prefill.prefill(PipelineRequest("r", 1, "x" * 1100, (), 6))
        result = await handle.wait()
    assert report.status is PrefillStatus.FAILED
    assert "do not fit" in report.error
    assert result.status is DecodeStatus.FAILED


async def test_requests_retracted_under_memory_pressure_keep_their_tokens(
    reference_lm: LanguageModel,
) -> None:
    # Each 45-token prompt lands on 3 pages and needs 5 for its 30 tokens: one fits the 7
    # pages alone, two running together cannot, so one of them is retracted and resumed.
    async with wired(reference_lm, num_pages=7) as w:
        w.engine.gate.clear()
        handles = [w.decode.admit(f"r{i}", i + 1, max_new_tokens=30) for i in range(2)]
        async with anyio.create_task_group() as group:
            for i in range(2):
                group.start_soon(w.prefill.prefill, request(f"r{i}", i + 1, tokens=30))
            for i in range(2):
                await w.decode.wait_phase(f"r{i}", DecodePhase.TRANSFER)
            # Both hold their pages: let both writes land, so both decode at once.
            w.engine.gate.set()
            results = [await handle.wait() for handle in handles]
        stats = w.decode.stats()
    expected = reference_lm.generate_colocated(PROMPT, [], max_new_tokens=30)
    assert [r.status for r in results] == [DecodeStatus.COMPLETED] * 2
    assert [list(r.tokens) for r in results] == [expected, expected]
    assert stats.retractions >= 1
    assert stats.resumptions == stats.retractions
    assert sum(r.retractions for r in results) == stats.retractions
    assert stats.pages_free == stats.pages_total


async def test_the_first_decode_step_reads_the_draft_state_prefill_shipped(
    reference_lm: LanguageModel,
) -> None:
    async with wired(reference_lm) as w:
        handle = w.decode.admit("r", 1, max_new_tokens=3)
        await w.prefill.prefill(request(tokens=3))
        result = await handle.wait()
        stats = w.decode.stats()
    assert result.status is DecodeStatus.COMPLETED
    ids = [token for token, _ in result.first_top]
    logprobs = [logprob for _, logprob in result.first_top]
    assert len(ids) == 4
    assert ids[0] == result.tokens[0]
    assert logprobs == sorted(logprobs, reverse=True)
    assert all(p <= 0 for p in logprobs)
    assert stats.draft_mismatches == 0
    assert stats.slots_free == stats.slots_total


async def test_steps_in_a_worker_thread_give_the_same_tokens(reference_lm: LanguageModel) -> None:
    # A model whose steps block runs them in a worker thread; the tokens do not change.
    async with wired(reference_lm) as w:
        w.decode.lm.blocking_steps = True
        handles = [w.decode.admit(f"r{i}", i + 1, max_new_tokens=6) for i in range(2)]
        async with anyio.create_task_group() as group:
            for i in range(2):
                group.start_soon(w.prefill.prefill, request(f"r{i}", i + 1))
            results = [await handle.wait() for handle in handles]
    expected = reference_lm.generate_colocated(PROMPT, [], max_new_tokens=6)
    assert [list(r.tokens) for r in results] == [expected, expected]
