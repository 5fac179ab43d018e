"""The demo end to end: encoder servers, prefill, decode, parity with the colocated model."""

from __future__ import annotations

import io

import pytest

from encdisagg._cli import main
from encdisagg.pipeline import DecodeStatus, DemoOptions, run_demo


def test_the_cli_demo_keeps_parity_over_zmq(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["demo", "--requests", "3", "--new-tokens", "5", "--encoders", "2"])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert status == 0, captured.out + captured.err
    assert len(lines) == 4
    assert all("parity ok" in line and "ttft=" in line and "tpot=" in line for line in lines[:3])
    summary = lines[-1]
    assert summary.startswith("demo: requests=3 completed=3 ")
    assert "leaked_pages=0 leaked_slots=0 kv_corrupt=0" in summary
    assert summary.endswith("parity=ok")
    assert "3/3" in captured.err  # the progress bar


def test_the_cli_kv_pages_flag_forces_retractions_and_keeps_parity(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["demo", "--requests", "12", "--concurrency", "6", "--new-tokens", "40"]
    status = main([*argv, "--kv-pages", "8", "--max-running", "4", "--quiet"])
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert status == 0, summary
    fields = dict(field.split("=", 1) for field in summary.removeprefix("demo: ").split())
    assert int(fields["retractions"]) > 0, summary
    assert (fields["leaked_pages"], fields["leaked_slots"], fields["kv_corrupt"]) == ("0",) * 3
    assert fields["parity"] == "ok"
    assert main(["demo", "--kv-pages", "0"]) == 2
    assert "kv_pages" in capsys.readouterr().err


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--abort-rate", "1.5"]) == 2
    assert "abort_rate" in capsys.readouterr().err
    assert main(["demo", "--model", "/nonexistent/checkpoint"]) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_demo_keeps_parity_over_mooncake(anyio_backend: str) -> None:
    report = await run_demo(
        DemoOptions(requests=3, transfer="mooncake", encoders=1, new_tokens=5, verbose=False),
        err=io.StringIO(),
    )
    assert report.backend == anyio_backend
    assert [o.status for o in report.outcomes] == [DecodeStatus.COMPLETED] * 3
    assert all(o.parity and o.kv_intact for o in report.outcomes)
    assert report.ok, report.summary_line()
    assert report.summary_line().endswith("parity=ok")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_abort_storm_leaks_nothing_and_corrupts_nothing(anyio_backend: str) -> None:
    out = io.StringIO()
    report = await run_demo(
        DemoOptions(
            requests=60,
            abort_rate=0.3,
            new_tokens=4,
            max_images=2,
            image_max_side=84,
            concurrency=8,
            seed=7,
        ),
        out=out,
        err=io.StringIO(),
    )
    summary = report.summary_line()
    aborted = [o for o in report.outcomes if o.status is DecodeStatus.ABORTED]
    completed = [o for o in report.outcomes if o.status is DecodeStatus.COMPLETED]
    assert len(aborted) + len(completed) == 60, summary
    assert len(aborted) >= 10, summary
    # Some aborts came while prefill held decode's pages: those waited for the drain.
    assert report.decode.held_releases >= 1, summary
    assert report.decode.drained_releases == report.decode.held_releases, summary
    assert report.decode.timed_out_releases == 0, summary
    assert report.leaked_pages == 0, summary
    assert report.leaked_slots == 0, summary
    assert report.kv_corrupt == 0, summary
    assert all(o.kv_intact for o in completed)
    assert all(o.parity for o in completed)
    assert report.parity_failures == ()
    assert report.ok, summary
    assert len(out.getvalue().splitlines()) == 60


@pytest.mark.anyio
async def test_a_small_kv_pool_with_aborts_keeps_parity_and_leaks_nothing() -> None:
    # Eight 16-token pages for up to eight requests in flight: running requests outgrow the
    # pool and are retracted (KV backed up, pages freed) and resumed, among aborts.
    report = await run_demo(
        DemoOptions(
            requests=24,
            abort_rate=0.3,
            new_tokens=12,
            max_images=2,
            concurrency=8,
            kv_pages=8,
            seed=3,
            verbose=False,
        ),
        err=io.StringIO(),
    )
    summary = report.summary_line()
    completed = [o for o in report.outcomes if o.status is DecodeStatus.COMPLETED]
    assert completed, summary
    assert all(o.parity and o.kv_intact for o in completed), summary
    assert report.decode.resumptions == report.decode.retractions, summary
    assert report.decode.draft_mismatches == 0, summary
    assert report.leaked_pages == 0, summary
    assert report.leaked_slots == 0, summary
    assert report.ok, summary
    assert f"retractions={report.decode.retractions}" in summary
