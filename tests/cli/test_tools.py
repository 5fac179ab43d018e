"""The shell commands' own answers: bad files, refused requests, the load summary."""

from __future__ import annotations

import argparse
import socket
from collections import Counter
from pathlib import Path

import pytest

from encdisagg._cli import build_parser
from encdisagg._cli._encode import guess_modality, run_encode
from encdisagg._cli._loadgen import LoadResult, images_for, latency_svg
from encdisagg._cli._receive import run_receive


def _closed_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_files_that_cannot_be_read_or_told_apart_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_encode(_args("encode", _closed_url(), str(tmp_path / "none.png"))) == 2
    assert "no such file" in capsys.readouterr().err
    odd = tmp_path / "notes.txt"
    odd.write_text("x")
    assert run_encode(_args("encode", _closed_url(), str(odd))) == 2
    assert "pass --modality" in capsys.readouterr().err
    assert [guess_modality(Path(name)) for name in ("a.JPG", "b.mp4", "c.flac", "d")] == [
        "image",
        "video",
        "audio",
        None,
    ]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_unreachable_server_exits_1_naming_it(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG")
    url = _closed_url()
    assert run_encode(_args("encode", url, str(image), "--backend", backend)) == 1
    err = capsys.readouterr().err
    assert err.startswith("encdisagg encode: error: ")
    assert url in err


def test_the_load_summary_and_its_plot() -> None:
    result = LoadResult([0.01 * n for n in range(1, 101)], Counter({503: 2}), elapsed_s=2.0)
    summary = result.summary()
    assert summary["requests"] == 102
    assert summary["errors"] == {"503": 2}
    assert (summary["p50_ms"], summary["p90_ms"], summary["p99_ms"]) == (500.0, 900.0, 990.0)
    assert summary["requests_per_s"] == 50.0
    svg = latency_svg(result.latencies_s)
    assert svg.startswith("<svg")
    assert svg.count("<rect") == 30


def test_repeated_images_come_from_those_made_before() -> None:
    args = _args("loadgen", "http://h:1", "--requests", "40", "--size", "8x8", "--repeat", "0.5")
    requests = images_for(args)
    flat = [image for items in requests for image in items]
    assert len(flat) == 40
    assert 5 < len(flat) - len(set(flat)) < 35, "about half are repeats"
    assert images_for(args) == requests, "the same seed makes the same load"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["loadgen", "http://h:1", "--size", "10"], "WIDTHxHEIGHT"),
        (["loadgen", "http://h:1", "--repeat", "1"], "must be in [0, 1)"),
        (["receive", "--count", "0"], "must be at least 1"),
    ],
)
def test_bad_values_are_refused_naming_them(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert said in capsys.readouterr().err


def test_a_fetch_needs_a_server_and_part_ids_of_the_printed_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_receive(_args("receive", "--transfer", "mooncake")) == 2
    assert "go with --from URL" in capsys.readouterr().err
    assert run_receive(_args("receive", "--from", _closed_url())) == 2
    assert run_receive(_args("receive", "--from", _closed_url(), "no-index")) == 2
    assert "REQUEST#INDEX" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_fetch_from_an_unreachable_server_exits_1_naming_the_part(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _closed_url()
    argv = ("receive", "--from", url, "gone#0", "--backend", backend)
    assert run_receive(_args(*argv)) == 1
    out = capsys.readouterr().out
    assert out.startswith("req_id=gone#0  error=")
    assert url in out
