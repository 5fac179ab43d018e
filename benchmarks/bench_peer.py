"""Our request lifecycle against SGLang 0.5.20's own, interleaved in one run.

Run as ``nox -s bench_peer`` (builds SGLang's venv first), or, with a venv built by
``../shared/peer/build_venv020.sh DIR``, as
``ENCDISAGG_PEER_VENV=DIR python benchmarks/bench_peer.py [--pairs 3] [--total 1600] [--quick]``;
writes ``bench_peer.json`` and ``bench_peer.png``. ``ENCDISAGG_PEER_DIR`` names the peer's
folder where it is not the sibling below.

**The peer** is ``run_once("full", c, n)`` of ``../shared/peer/bench.py`` (a sibling of the
repository root): SGLang's ``MMEncoder`` acquires a request, stages a 2x4 float16 embedding,
sends it to a Mooncake destination over an engine whose calls return at once, then pushes the
metadata frame over a real ZMQ PUSH socket to a PULL sink thread on 127.0.0.1, and releases.
It runs on asyncio, in a long-lived child process of the peer venv's python. Its
``one_lifecycle`` is wrapped there only to read the clock before and after each call, so its
latencies can be reported beside ours; what a lifecycle does is unchanged.

**Ours**, per lifecycle, the closest equivalent through the public API: ``encode``
(``NullVisionModel``, 2 tokens x 4 hidden, float16), ``send`` to a ``MooncakeDestination``
over a no-op transfer engine (``register``/``deregister``/``write`` return at once), ``send``
to a ``ZmqDestination`` whose PULL sink is a real socket drained by a thread on 127.0.0.1,
with ``default_receive_count=2`` so the second send releases the request, then ``release``
(a no-op by then). The engine says ``blocking = False`` (its calls may run inline on the event
loop); a second variant says ``blocking = True`` (worker-thread calls), measured beside it.
It runs in a long-lived child process of this project's python, on asyncio and on Trio.

**Both over Mooncake** (``_peer_mooncake.py``): one more pair of sides, ``peer_mooncake`` and
``ours_mooncake``, where each side writes into a receiver's registered buffer with the real
Mooncake transfer engine over TCP on 127.0.0.1 instead of calling a no-op engine: SGLang's
own ``MooncakeTransferEngine`` under its ``MMEncoder`` (which registers each embedding when it
stages it, writes in ``asyncio.to_thread`` and deregisters at release), our ``MooncakeEngine``
under our ``Encoder``. The receiver is one process of its own, shared by both sides. Measured
when both children can import ``mooncake`` (the project's ``mooncake-cpu`` extra), else left
out with a note.

Both sides run in children so that neither shares a process, an interpreter lock or threads
with the other or with this harness, which only waits on a pipe while a side runs. Each side
builds a fresh encoder and sink per run, runs one untimed warm-up lifecycle, then ``c`` tasks
of ``n / c`` lifecycles each; the clock covers those tasks only. After every run each side
checks that nothing leaked: no request state, every registration undone, and the sink
received every push.

Cells: concurrency 1 and 64 x our backend (asyncio, Trio). Per cell, after one discarded
warm-up run of each side, ``--pairs`` rounds alternate the order (peer, ours, ours blocking,
peer over Mooncake, ours over Mooncake; then the reverse). A cell reports each side's
lifecycles/s (median and every run), ours/peer as the median of the per-round ratios (the
Mooncake sides against each other), and p50/p99 latency over every timed lifecycle.

``--baseline-src DIR`` adds our encoder as an earlier checkout has it (``DIR`` is that
checkout's ``src`` folder, importable instead of this one): two more sides, ``base`` and
``base_blocking``, in every round beside the others, and each cell reports ours/base and
blocking/base (medians of per-round ratios): a change measured side by side, same shape on
both sides, in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

# Only the standard library at the top: the peer's child imports this file too.
from _common import (
    QUICK_RESULTS_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    ChildSide,
    Options,
    latency_summary,
    write_json,
)
from _peer_mooncake import SLOT_BYTES, mooncake_receiver
from _peer_report import GOALS, LIKE_FOR_LIKE_GOALS, headlines, mooncake_table, plot, table
from _peer_sides import HIDDEN, TOKENS, serve_ours, serve_peer

NAME = "bench_peer"
PEER_DIR_ENV = "ENCDISAGG_PEER_DIR"
#: SGLang's peer benchmark, beside the repository root unless $ENCDISAGG_PEER_DIR names it.
PEER_DIR = Path(os.environ.get(PEER_DIR_ENV) or REPO_ROOT.parent / "shared" / "peer")
PEER_DIR_SHOWN = "../shared/peer"  # as the repository sees it; never a machine path
PEER_VENV_ENV = "ENCDISAGG_PEER_VENV"
CONCURRENCY = (1, 64)
BACKENDS = ("asyncio", "trio")
#: The contestants of a round, in the order of even rounds (odd rounds reverse it).
SIDES = ("peer", "ours", "ours_blocking")
#: Both sides over the real Mooncake engine, into the receiver's buffer (``_peer_mooncake``).
MOONCAKE_SIDES = ("peer_mooncake", "ours_mooncake")
#: With ``--baseline-src``: an earlier checkout of ours, beside the others.
BASELINE_SIDES = ("base", "base_blocking")
START_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 600.0


# -- the harness ------------------------------------------------------------------------------


def _side(label: str, command: Sequence[str], *, src: Path | None = None) -> ChildSide:
    return ChildSide(
        "bench_peer",
        label,
        command,
        src=src,
        start_timeout_s=START_TIMEOUT_S,
        run_timeout_s=RUN_TIMEOUT_S,
    )


def _peer_python(venv: str | None) -> Path:
    if not (PEER_DIR / "bench.py").is_file():
        raise SystemExit(
            f"bench_peer: SGLang's peer benchmark is missing: no bench.py in {PEER_DIR_SHOWN} "
            f"(the folder 'shared/peer' beside the repository root, here {PEER_DIR})"
        )
    if not venv:
        raise SystemExit(
            f"bench_peer: set {PEER_VENV_ENV} (or --peer-venv) to a venv built by "
            f"{PEER_DIR_SHOWN}/build_venv020.sh DIR, or run `nox -s bench_peer`"
        )
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise SystemExit(
            f"bench_peer: {python} does not exist; build the venv with "
            f"{PEER_DIR_SHOWN}/build_venv020.sh {venv}"
        )
    return python


def _run_side(
    sides: dict[str, ChildSide],
    side: str,
    concurrency: int,
    total: int,
    backend: str,
    receiver: dict[str, Any] | None,
) -> dict[str, Any]:
    """One run of ``side``; the Mooncake sides write into ``receiver``'s buffer."""
    name = side.removesuffix("_mooncake")
    command: dict[str, Any] = {
        "concurrency": concurrency,
        "total": total,
        "receiver": receiver if side != name else None,
    }
    if name == "peer":
        return sides["peer"].run(**command)
    blocking = name.endswith("_blocking")
    return sides[name.removesuffix("_blocking")].run(**command, backend=backend, blocking=blocking)


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [run["rate"] for run in runs]
    pooled = [seconds for run in runs for seconds in run["latencies_s"]]
    return {
        "median_per_s": statistics.median(rates),
        "runs_per_s": rates,
        "lifecycles_per_run": runs[0]["n"],
        "latency": latency_summary(pooled),
        "latency_per_run": [
            {k: v for k, v in latency_summary(run["latencies_s"]).items() if k != "n"}
            for run in runs
        ],
    }


def _ratios(runs: list[dict[str, Any]], under: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [run["rate"] / base["rate"] for run, base in zip(runs, under, strict=True)]
    return {"median": statistics.median(ratios), "per_pair": ratios}


def _cell(
    sides: dict[str, ChildSide],
    concurrency: int,
    backend: str,
    total: int,
    pairs: int,
    receiver: dict[str, Any] | None,
) -> dict[str, Any]:
    total = (total // concurrency) * concurrency
    warmup = max(concurrency, (min(total, 256) // concurrency) * concurrency)
    contestants = (
        SIDES
        + (MOONCAKE_SIDES if receiver is not None else ())
        + (BASELINE_SIDES if "base" in sides else ())
    )
    for side in contestants:
        _run_side(sides, side, concurrency, warmup, backend, receiver)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in contestants}
    order_log = []
    for index in range(pairs):
        order = contestants if index % 2 == 0 else tuple(reversed(contestants))
        order_log.append(list(order))
        for side in order:
            runs[side].append(_run_side(sides, side, concurrency, total, backend, receiver))
    cell: dict[str, Any] = {
        "concurrency": concurrency,
        "backend": backend,
        "peer_backend": "asyncio",
        "lifecycles_per_run": total,
        "warmup_lifecycles": warmup,
        "order": order_log,
        **{side: _summarise(runs[side]) for side in contestants},
    }
    for side in contestants:
        if side != "peer" and side not in MOONCAKE_SIDES:
            cell[f"{side}_over_peer"] = _ratios(runs[side], runs["peer"])
    if receiver is not None:
        cell["ours_mooncake_over_peer_mooncake"] = _ratios(
            runs["ours_mooncake"], runs["peer_mooncake"]
        )
    if "base" in sides:
        cell["ours_over_base"] = _ratios(runs["ours"], runs["base"])
        cell["ours_blocking_over_base"] = _ratios(runs["ours_blocking"], runs["base_blocking"])
    return cell


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="rounds per cell (at least 3)")
    parser.add_argument("--total", type=int, help="lifecycles per run (default 1600; quick 320)")
    parser.add_argument("--quick", action="store_true", help="small runs, into results/quick/")
    parser.add_argument("--out", type=Path, help="folder for the JSON and PNG files")
    parser.add_argument(
        "--peer-venv", default=os.environ.get(PEER_VENV_ENV), help=f"default: ${PEER_VENV_ENV}"
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="the src folder of an earlier checkout, measured beside this one in every round",
    )
    parser.add_argument("--serve", choices=("peer", "ours"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pairs < 3:
        parser.error("--pairs must be at least 3")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.serve == "peer":
        return serve_peer(PEER_DIR)
    if args.serve == "ours":
        return serve_ours()
    peer_python = _peer_python(args.peer_venv)
    total = args.total or (320 if args.quick else 1600)
    if total < max(CONCURRENCY):
        raise SystemExit(f"bench_peer: --total must be at least {max(CONCURRENCY)}")
    options = Options(
        quick=args.quick,
        out=args.out or (QUICK_RESULTS_DIR if args.quick else RESULTS_DIR),
        repeats=args.pairs,
    )
    script = str(Path(__file__).resolve())
    sides: dict[str, ChildSide] = {}
    notes: list[str] = []
    with ExitStack() as stack:

        def start(name: str, side: ChildSide) -> None:
            sides[name] = side
            stack.callback(side.close)

        start("peer", _side("the SGLang peer", [str(peer_python), script, "--serve", "peer"]))
        start("ours", _side("our encoder", [sys.executable, script, "--serve", "ours"]))
        if args.baseline_src is not None:
            if not (args.baseline_src / "encdisagg" / "__init__.py").is_file():
                raise SystemExit(f"bench_peer: no encdisagg package in {args.baseline_src}")
            command = [sys.executable, script, "--serve", "ours"]
            start("base", _side("the baseline encoder", command, src=args.baseline_src.resolve()))
        lacking = [side.label for side in sides.values() if not side.hello.get("mooncake", True)]
        receiver = None
        if lacking:
            notes.append(f"Mooncake cell not measured: no mooncake package in {', '.join(lacking)}")
            print(f"bench_peer: {notes[-1]}", flush=True)
        else:
            receiver = stack.enter_context(mooncake_receiver(max(CONCURRENCY)))
        print(
            f"peer: sglang {sides['peer'].hello['sglang']}, torch {sides['peer'].hello['torch']},"
            f" python {sides['peer'].hello['python']}; ours: encdisagg "
            f"{sides['ours'].hello['encdisagg']}; {total} lifecycles per run, {args.pairs} "
            "rounds per cell",
            flush=True,
        )
        cells = []
        for concurrency in CONCURRENCY:
            for backend in BACKENDS:
                cell = _cell(sides, concurrency, backend, total, args.pairs, receiver)
                cells.append(cell)
                print(table([cell]).splitlines()[-1], flush=True)
                if receiver is not None:
                    print("Mooncake: " + mooncake_table([cell]).splitlines()[-1], flush=True)
    print()
    print(table(cells))
    if receiver is not None:
        print()
        print(mooncake_table(cells))
    data = {
        "settings": {
            "pairs": args.pairs,
            "lifecycles_per_run": total,
            "embedding": {"tokens": TOKENS, "hidden": HIDDEN, "dtype": "float16"},
            "peer_bench": f"{PEER_DIR_SHOWN}/bench.py run_once('full', c, n)",
            "ours": "encode + send(MooncakeDestination, no-op engine) + "
            "send(ZmqDestination, PULL sink thread) + release; default_receive_count=2",
            "mooncake_cell": None
            if receiver is None
            else "both sides over Mooncake TCP on 127.0.0.1 (P2P handshake) into one receiver "
            f"process's registered buffer, {SLOT_BYTES}-byte slot per task; peer: SGLang's "
            "MooncakeTransferEngine, embedding registered when staged, deregistered at release; "
            "ours: MooncakeEngine, staging arena registered once",
        },
        "peer_versions": {k: v for k, v in sides["peer"].hello.items() if k != "ready"},
        "our_versions": {k: v for k, v in sides["ours"].hello.items() if k != "ready"},
        "baseline": None if args.baseline_src is None else "an earlier checkout's src, beside",
        "goals": {
            "ours (no-op engine inline)": {f"c={c}": f">= {g}x" for c, g in GOALS.items()},
            "blocking engine and Mooncake cell": {
                f"c={c}": f">= {g}x" for c, g in LIKE_FOR_LIKE_GOALS.items()
            },
        },
        "notes": notes,
        "cells": cells,
        "table_md": table(cells),
        "mooncake_table_md": None if receiver is None else mooncake_table(cells),
        "headline": headlines(cells),
    }
    write_json(options, NAME, data)
    plot(options, NAME, cells)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
