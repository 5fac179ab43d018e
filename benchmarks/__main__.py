"""Run the benchmark suite: ``python -m benchmarks [--quick] [--only NAMES] [--soak]``.

Each benchmark runs in its own Python process (so none inherits another's threads, memory or
event loop), writes ``<name>.json`` (and a PNG plot) into the results folder, and the runner
gathers the headline figures of every benchmark with results in that folder (those run now,
and the latest results of the others) into ``summary.json`` and ``summary.md``. A run into
the default folder also rewrites the results table of ``docs/benchmarks.md``.

``--soak`` runs the reliability tests at soak sizes (20,000 requests against a real server,
5,000 Hypothesis examples per route) and records their report as ``soak.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BENCH_DIR,
    QUICK_RESULTS_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    headline,
    machine_info,
    python_env,
)

DOCS = REPO_ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- results:begin (written by python -m benchmarks) -->"
END = "<!-- results:end -->"


@dataclass(frozen=True)
class Bench:
    """One benchmark script and how to run it."""

    name: str
    script: str
    what: str
    #: Extra arguments: (out folder, quick) -> argv.
    args: Callable[[Path, bool], list[str]] = field(default=lambda out, quick: [])
    #: Headline figures from its JSON, for scripts that do not write ``headline`` themselves.
    headlines: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None
    timeout_s: float = 1800.0
    #: The JSON file it writes (without ``.json``), if not its name.
    result: str | None = None


def _own_args(out: Path, quick: bool) -> list[str]:
    return ["--out", str(out), *(["--quick"] if quick else [])]


def _decode_headlines(data: dict[str, Any]) -> list[dict[str, Any]]:
    case = data["cases"]["all_checked"]
    small, large = case["runs"]
    ratio = case["per_entry_ratio_100k_vs_10k"]
    base = data["cases"].get("bare_scan_baseline", {}).get("per_entry_ratio_100k_vs_10k")
    rows = [
        headline(
            f"decode compaction, {run['entries']:,} entries",
            run["per_entry_us"],
            "us/entry",
            note=f"one pop_transferred pass: {run['min_s'] * 1e3:.2f} ms (min of repeats)",
        )
        for run in (small, large)
    ]
    rows.append(
        headline(
            "decode compaction: per-entry time 100k / 10k",
            ratio,
            "x",
            note=f"a bare scan of the same queue: {base:.2f}x" if base else "",
        )
    )
    step = data["cases"].get("pop_transferred_plus_prebuilt_step")
    if step:
        small, large = step["runs"]
        rows.append(
            headline(
                "decode step (pop_transferred + prebuilt batch): per-entry time 100k / 10k",
                step["per_entry_ratio_100k_vs_10k"],
                "x",
                note=f"{small['min_s'] * 1e3:.2f} ms at 10k, {large['min_s'] * 1e3:.2f} ms at 100k",
            )
        )
    rows.extend(
        headline(
            f"batched decode, tiny model, {row['batch']} requests",
            row["tokens_per_s"],
            "tokens/s",
            note=f"{row['step_ms']:.2f} ms per step",
        )
        for row in data.get("batched_decode", ())
    )
    return rows


def _models_headlines(data: dict[str, Any]) -> list[dict[str, Any]]:
    if isinstance(data.get("headline"), list):  # bench_models writes its own (one per family)
        return list(data["headline"])
    rows = []
    for result in data["results"]:
        if result["batch"] != 1:
            continue
        rows.append(
            headline(
                f"tiny model {result['image']}: preprocess + forward",
                (result["preprocess"]["median_s"] + result["forward"]["median_s"]) * 1e3,
                "ms",
                note=(
                    f"preprocess {result['preprocess']['median_s'] * 1e3:.0f} ms, forward "
                    f"{result['forward']['median_s'] * 1e3:.0f} ms, {result['tokens']} tokens"
                ),
            )
        )
    return rows


def _generic_headlines(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Scripts of others that write a ``headline`` list like ours, or nothing we know."""
    rows = data.get("headline")
    return list(rows) if isinstance(rows, list) else []


BENCHES: tuple[Bench, ...] = (
    Bench(
        "transfer", "bench_transfer.py", "staged-embedding delivery vs raw Mooncake/ZMQ", _own_args
    ),
    Bench(
        "lifecycle", "bench_lifecycle.py", "encode+send+release, null model, loopback", _own_args
    ),
    Bench(
        "instructions",
        "bench_instructions.py",
        "the one-task lifecycle and its floor in instructions (callgrind)",
        _own_args,
    ),
    Bench("http", "bench_http.py", "/encode + /send through Hypercorn, c=64", _own_args),
    Bench("batching", "bench_batching.py", "tiny model, max_batch_size 1 vs 8, c=16", _own_args),
    Bench(
        "responsiveness",
        "bench_server.py",
        "/health while 200 encodes of 1280x720 images run",
        lambda out, quick: ["--out", str(out), *(["--quick"] if quick else [])],
        _generic_headlines,
        result="server",
    ),
    Bench(
        "hostile",
        "bench_hostile.py",
        "peak RSS and /health while 200 encodes of 1280x720 images run",
        _own_args,
    ),
    Bench(
        "decode",
        "bench_decode.py",
        "decode queue compaction, 10k and 100k entries",
        lambda out, quick: [
            "--out",
            str(out / "decode.json"),
            *(["--repeats", "3"] if quick else []),
        ],
        _decode_headlines,
    ),
    Bench(
        "cache",
        "bench_cache.py",
        "prefix / global embedding cache",
        lambda out, quick: ["--out", str(out), *(["--quick"] if quick else [])],
        _generic_headlines,
    ),
    Bench(
        "models",
        "bench_models.py",
        "tiny models preprocess and forward, one row per family",
        lambda out, quick: [
            "--output",
            str(out / "models.json"),
            "--repeats",
            "2" if quick else "5",
        ],
        _models_headlines,
    ),
    Bench(
        "preprocess",
        "bench_preprocess.py",
        "images/s of preprocessing per core: HF processor vs fast vs reference vs decode",
        _own_args,
    ),
    Bench("epd", "bench_epd.py", "E->P->D vs colocated TTFT/TPOT", _own_args),
    Bench(
        "fleet",
        "bench_fleet.py",
        "etcd-discovered fleet: 1-3 encoders, host death to removal",
        _own_args,
    ),
    Bench(
        "affinity",
        "bench_affinity.py",
        "3-encoder fleet, ~30 % repeated images: cache hit rate, affine vs least-loaded",
        _own_args,
    ),
    Bench(
        "decoders",
        "bench_decoders.py",
        "strict decoding: the project's decoders vs msgspec Structs, same bodies",
        _own_args,
    ),
    Bench(
        "cli",
        "bench_cli.py",
        "encdisagg serve: time to answer a bad flag, a busy port, a bad config file",
        _own_args,
    ),
)


def _run(bench: Bench, out: Path, quick: bool) -> dict[str, Any]:
    script = BENCH_DIR / bench.script
    if not script.exists():
        print(f"== {bench.name}: {bench.script} is not in this checkout; skipped")
        return {"name": bench.name, "status": "missing", "seconds": 0.0}
    command = [sys.executable, str(script), *bench.args(out, quick)]
    print(f"== {bench.name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=REPO_ROOT, env=python_env(), timeout=bench.timeout_s, check=False
        )
        status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {bench.timeout_s:.0f} s"
    seconds = time.perf_counter() - start
    print(f"== {bench.name}: {status} in {seconds:.1f} s", flush=True)
    return {"name": bench.name, "status": status, "seconds": seconds}


def _headlines(bench: Bench, out: Path) -> list[dict[str, Any]]:
    path = out / f"{bench.result or bench.name}.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    extract = bench.headlines or _generic_headlines
    try:
        return extract(data)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        return [headline(f"{bench.name}: unreadable results", math.nan, "", note=repr(exc))]


def _earlier(bench: Bench, out: Path) -> dict[str, Any]:
    data = json.loads((out / f"{bench.result or bench.name}.json").read_text())
    machine = data.get("machine")
    when = machine.get("date", "an earlier run") if isinstance(machine, dict) else "an earlier run"
    return {"name": bench.name, "status": f"from {when}", "seconds": 0.0}


def _fmt(value: float) -> str:
    if value != value:  # NaN
        return "n/a"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and value == 0):
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _table(rows: Sequence[tuple[Bench, list[dict[str, Any]], dict[str, Any]]]) -> str:
    lines = [
        "| benchmark | figure | value | goal | met | notes |",
        "|---|---|---|---|---|---|",
    ]
    for bench, heads, run in rows:
        if not heads:
            lines.append(f"| {bench.name} | {bench.what} | — | | | {run['status']} |")
            continue
        for head in heads:
            met = {True: "yes", False: "**no**", None: ""}[head.get("met")]
            lines.append(
                f"| {bench.name} | {head['figure']} | {_fmt(head['value'])} {head['unit']} | "
                f"{head.get('goal') or ''} | {met} | {head.get('note', '')} |"
            )
    return "\n".join(lines)


def _machine_line(machine: dict[str, Any]) -> str:
    packages = machine.get("packages", {})
    parts = [
        f"{machine['cpu']} ({machine['cpu_count']} cores)",
        f"{machine.get('memory_gib')} GiB",
        machine["os"],
        f"Python {machine['python']}",
    ]
    parts += [
        f"{name} {packages[name]}"
        for name in ("torch", "anyio", "trio", "pyzmq")
        if name in packages
    ]
    mooncake = packages.get("mooncake-transfer-engine-non-cuda") or packages.get(
        "mooncake-transfer-engine"
    )
    if mooncake:
        parts.append(f"Mooncake {mooncake}")
    if machine.get("commit"):
        parts.append(f"commit {machine['commit']}")
    return ", ".join(parts) + f"; run {machine['date']}"


def _soak(out: Path) -> dict[str, Any]:
    report = out / "soak.json"
    report.unlink(missing_ok=True)  # each test merges its section into a fresh report
    env = python_env()
    env["ENCDISAGG_SOAK"] = "1"
    env["ENCDISAGG_SOAK_REPORT"] = str(report)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests/reliability",
        "-q",
        "-p",
        "no:cacheprovider",
        "--deselect",
        "tests/reliability/test_bench_runner.py",
        # Soak-sized tests run for minutes: no per-test timeout or traceback dumps.
        "--timeout",
        "3600",
        "-o",
        "faulthandler_timeout=0",
    ]
    print(f"== soak: {' '.join(command[1:])} (ENCDISAGG_SOAK=1)", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, check=False, timeout=7200)
    seconds = time.perf_counter() - start
    status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    print(f"== soak: {status} in {seconds:.1f} s", flush=True)
    return {"name": "soak", "status": status, "seconds": seconds}


def _soak_headlines(out: Path) -> list[dict[str, Any]]:
    path = out / "soak.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return list(data.get("headline", []))


def main(argv: Sequence[str] | None = None) -> int:
    names = [bench.name for bench in BENCHES]
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--only", help=f"comma-separated subset of: {', '.join(names)}")
    parser.add_argument("--skip", help="comma-separated benchmarks to leave out")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results)")
    parser.add_argument("--soak", action="store_true", help="also run the reliability soak")
    parser.add_argument("--soak-only", action="store_true", help="run only the soak")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for bench in BENCHES:
            present = "" if (BENCH_DIR / bench.script).exists() else "  (not in this checkout)"
            print(f"{bench.name:>15}  {bench.script:<20} {bench.what}{present}")
        return 0
    chosen = list(BENCHES)
    if args.only:
        wanted = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = wanted - set(names)
        if unknown:
            parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
        chosen = [bench for bench in BENCHES if bench.name in wanted]
    if args.skip:
        skipped = {name.strip() for name in args.skip.split(",")}
        chosen = [bench for bench in chosen if bench.name not in skipped]
    if args.soak_only:
        chosen = []
    out: Path = args.out or (QUICK_RESULTS_DIR if args.quick else RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    started = time.perf_counter()
    runs = [_run(bench, out, args.quick) for bench in chosen]
    soak = _soak(out) if (args.soak or args.soak_only) else None
    # Every benchmark with results in the folder: those run now, and the latest results of
    # the others (so re-running one benchmark refreshes its rows and keeps the rest).
    ran = {bench.name: run for bench, run in zip(chosen, runs, strict=True)}
    rows = []
    for bench in BENCHES:
        heads = _headlines(bench, out)
        if bench.name in ran:
            rows.append((bench, heads, ran[bench.name]))
        elif heads:
            rows.append((bench, heads, _earlier(bench, out)))
    machine = machine_info()
    table = _table(rows)
    soak_rows = _soak_headlines(out)
    if soak_rows:
        # From this run, or from an earlier --soak run into the same folder.
        soak_run = soak or {"name": "soak", "status": "earlier run", "seconds": 0.0}
        soak_bench = Bench("soak", "tests/reliability", "reliability soak")
        table += "\n" + _table([(soak_bench, soak_rows, soak_run)]).split("\n", 2)[2]
    summary = {
        "quick": args.quick,
        "machine": machine,
        "runs": runs + ([soak] if soak else []),
        "headline": {
            **{bench.name: heads for bench, heads, _ in rows},
            **({"soak": soak_rows} if soak_rows else {}),
        },
        "seconds": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = f"Machine: {_machine_line(machine)}.\n\n{table}\n"
    (out / "summary.md").write_text(markdown)
    print()
    print(markdown)
    if not args.quick and args.out is None and DOCS.exists():
        _update_docs(markdown)
    failed = [run["name"] for run in summary["runs"] if run["status"] not in ("ok", "missing")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _update_docs(markdown: str) -> None:
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOCS.name} has no results markers; not updated")
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{markdown}{END}{tail}")
    print(f"updated {DOCS}")


if __name__ == "__main__":
    raise SystemExit(main())
