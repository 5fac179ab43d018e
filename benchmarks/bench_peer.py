"""Our request lifecycle against SGLang 0.5.20's own, interleaved in one run.

Run as ``nox -s bench_peer`` (builds SGLang's venv first), or, with a venv built by
``../shared/peer/build_venv020.sh DIR``, as
``ENCDISAGG_PEER_VENV=DIR python benchmarks/bench_peer.py [--pairs 3] [--total 1600] [--quick]``;
writes ``bench_peer.json`` and ``bench_peer.png``.

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

Both sides run in children so that neither shares a process, an interpreter lock or threads
with the other or with this harness, which only waits on a pipe while a side runs. Each side
builds a fresh encoder and sink per run, runs one untimed warm-up lifecycle, then ``c`` tasks
of ``n / c`` lifecycles each; the clock covers those tasks only. After every run each side
checks that nothing leaked: no request state, every registration undone, and the sink
received every push.

Cells: concurrency 1 and 64 x our backend (asyncio, Trio). Per cell, after one discarded
warm-up run of each side, ``--pairs`` rounds alternate the order (peer, ours, ours blocking;
then the reverse). A cell reports each side's lifecycles/s (median and every run), ours/peer
as the median of the per-round ratios, and p50/p99 latency over every timed lifecycle.

``--baseline-src DIR`` adds our encoder as an earlier checkout has it (``DIR`` is that
checkout's ``src`` folder, importable instead of this one): two more sides, ``base`` and
``base_blocking``, in every round beside the others, and each cell reports ours/base and
blocking/base (medians of per-round ratios): a change measured side by side, same shape on
both sides, in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import selectors
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

# Only the standard library at the top: the peer's child imports this file too.
from _common import (
    QUICK_RESULTS_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    Options,
    headline,
    latency_summary,
    python_env,
    write_json,
    write_png,
)

NAME = "bench_peer"
PEER_DIR = REPO_ROOT.parent / "shared" / "peer"
PEER_DIR_SHOWN = "../shared/peer"  # as the repository sees it; never a machine path
PEER_VENV_ENV = "ENCDISAGG_PEER_VENV"
CONCURRENCY = (1, 64)
BACKENDS = ("asyncio", "trio")
#: Goals of ours/peer once the encoder core runs its no-op engine calls inline.
GOALS = {1: 1.2, 64: 2.0}
TOKENS = 2
HIDDEN = 4
ITEMS = (b"image",)
#: The contestants of a round, in the order of even rounds (odd rounds reverse it).
SIDES = ("peer", "ours", "ours_blocking")
#: With ``--baseline-src``: an earlier checkout of ours, beside the others.
BASELINE_SIDES = ("base", "base_blocking")
START_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 600.0
SINK_WAIT_S = 5.0


# -- the child processes' side: JSON lines over stdin/stdout ----------------------------------


def _serve(handle: Callable[[dict[str, Any]], dict[str, Any]], hello: dict[str, Any]) -> int:
    """Answer one JSON line on stdout per JSON line on stdin, until stdin closes.

    Whatever the libraries print goes to stderr: stdout is kept for the answers only.
    """
    channel: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    channel.write(json.dumps({"ready": True, **hello}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = handle(json.loads(line))
        except BaseException:  # the harness reports it and stops
            answer = {"error": traceback.format_exc()}
        channel.write(json.dumps(answer) + "\n")
    return 0


def _serve_peer(peer_dir: Path) -> int:
    import asyncio
    from types import SimpleNamespace
    from unittest.mock import patch

    spec = importlib.util.spec_from_file_location("sglang_peer_bench", peer_dir / "bench.py")
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import sglang
    import torch

    untimed = bench.one_lifecycle
    latencies: list[float] = []

    async def timed_lifecycle(enc: Any, rid: str, dest: Any, emb: Any) -> None:
        start = time.perf_counter()
        await untimed(enc, rid, dest, emb)
        if rid != "warmup":
            latencies.append(time.perf_counter() - start)

    # run_once looks the name up at call time, so every lifecycle it runs goes through here.
    bench.one_lifecycle = timed_lifecycle
    # What the peer's own command line does around run_once: the Mooncake backend.
    backend = SimpleNamespace(encoder_transfer_backend="mooncake")

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        latencies.clear()
        with patch.object(bench.srv, "get_disagg", return_value=backend):
            rate, n = asyncio.run(bench.run_once("full", command["concurrency"], command["total"]))
        if len(latencies) != n:
            raise AssertionError(f"timed {len(latencies)} lifecycles, run_once counted {n}")
        return {"rate": rate, "n": n, "latencies_s": list(latencies)}

    hello = {
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    return _serve(handle, hello)


class _NoopEngine:
    """A transfer engine whose calls return at once; it only counts registrations.

    ``blocking = False`` tells the Encoder its calls may run inline on the event loop.
    """

    blocking = False

    def __init__(self) -> None:
        # list.append is atomic, so worker-thread calls cannot lose a count.
        self._registered: list[int] = []
        self._deregistered: list[int] = []

    @property
    def session_id(self) -> str:
        return "127.0.0.1:1"

    def register(self, ptr: int, nbytes: int) -> None:
        self._registered.append(ptr)

    def deregister(self, ptr: int) -> None:
        self._deregistered.append(ptr)

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        return None

    def regions_held(self) -> int:
        return len(self._registered) - len(self._deregistered)


class _NoopBlockingEngine(_NoopEngine):
    """The same no-op engine, declaring that its calls block (worker-thread calls)."""

    blocking = True


class _ZmqSink:
    """A PULL socket on 127.0.0.1 that a thread drains, counting multipart messages."""

    def __enter__(self) -> _ZmqSink:
        import zmq

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self.port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.received = 0  # written by the drain thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="zmq sink", daemon=True)
        self._thread.start()
        return self

    def _drain(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(50):
                self._socket.recv_multipart()
                self.received += 1
        self._socket.close(linger=0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._context.term()


async def _our_run(concurrency: int, total: int, blocking: bool) -> dict[str, Any]:
    import anyio
    import torch

    from encdisagg import (
        Encoder,
        EncoderConfig,
        EncodeRequest,
        MooncakeDestination,
        ZmqDestination,
    )
    from encdisagg.models import NullVisionModel

    engine = _NoopBlockingEngine() if blocking else _NoopEngine()
    model = NullVisionModel(hidden_size=HIDDEN, tokens_per_item=TOKENS, dtype=torch.float16)
    config = EncoderConfig(
        transfer="mooncake",
        default_receive_count=2,
        max_queued_jobs=max(1024, 2 * concurrency),
    )
    per_worker = total // concurrency
    latencies: list[float] = []
    with _ZmqSink() as sink:
        mooncake = MooncakeDestination("session", 1, f"127.0.0.1:{sink.port}")
        pull = ZmqDestination(f"tcp://127.0.0.1:{sink.port}")
        async with Encoder(config, model=model, engine=engine) as encoder:

            async def lifecycle(rid: str) -> None:
                await encoder.encode(EncodeRequest(rid, ITEMS))
                await encoder.send(rid, mooncake)
                await encoder.send(rid, pull)  # the second destination releases it
                await encoder.release(rid)

            async def worker(index: int) -> None:
                for i in range(per_worker):
                    start = time.perf_counter()
                    await lifecycle(f"r{index}-{i}")
                    latencies.append(time.perf_counter() - start)

            await lifecycle("warmup")
            start = time.perf_counter()
            async with anyio.create_task_group() as group:
                for index in range(concurrency):
                    group.start_soon(worker, index)
            elapsed = time.perf_counter() - start
            stats = encoder.stats()
            held = engine.regions_held()
            if (stats.live_requests, stats.staged_bytes, stats.inflight_transfers) != (0, 0, 0):
                raise AssertionError(f"leaked request state: {stats}")
            if stats.registered_regions != held:
                raise AssertionError(f"stats() counts {stats} but the engine holds {held}")
        if engine.regions_held() != 0:
            raise AssertionError(f"{engine.regions_held()} registrations never undone")
        n = per_worker * concurrency
        with anyio.move_on_after(SINK_WAIT_S):
            while sink.received < n + 1:
                await anyio.sleep(0.01)
        if sink.received != n + 1:
            raise AssertionError(f"the sink received {sink.received} pushes of {n + 1}")
    return {"rate": n / elapsed, "n": n, "latencies_s": latencies}


def _serve_ours() -> int:
    import anyio

    import encdisagg

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        return anyio.run(
            _our_run,
            command["concurrency"],
            command["total"],
            command["blocking"],
            backend=command["backend"],
        )

    hello = {"encdisagg": encdisagg.__version__, "python": sys.version.split()[0]}
    return _serve(handle, hello)


# -- the harness ------------------------------------------------------------------------------


class _Side:
    """A long-lived child process answering run commands as JSON lines."""

    def __init__(self, label: str, command: Sequence[str], *, src: Path | None = None) -> None:
        self.label = label
        env = python_env()
        if src is not None:
            # That checkout's package is imported instead of this one's.
            env["PYTHONPATH"] = os.pathsep.join([str(src), env["PYTHONPATH"]])
        self.process = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            cwd=REPO_ROOT,
            env=env,
        )
        self.hello = self._answer(START_TIMEOUT_S, "start")

    def _answer(self, timeout_s: float, what: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout=timeout_s):
                raise SystemExit(f"bench_peer: {self.label} did not {what} in {timeout_s:.0f} s")
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait(10)
            raise SystemExit(f"bench_peer: {self.label} exited (code {code}) during {what}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise SystemExit(f"bench_peer: {self.label} failed during {what}:\n{answer['error']}")
        return answer

    def run(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer(RUN_TIMEOUT_S, f"run {command}")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()


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
    sides: dict[str, _Side], side: str, concurrency: int, total: int, backend: str
) -> dict[str, Any]:
    if side == "peer":
        return sides["peer"].run(concurrency=concurrency, total=total)
    blocking = side.endswith("_blocking")
    return sides[side.removesuffix("_blocking")].run(
        concurrency=concurrency, total=total, backend=backend, blocking=blocking
    )


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
    sides: dict[str, _Side], concurrency: int, backend: str, total: int, pairs: int
) -> dict[str, Any]:
    total = (total // concurrency) * concurrency
    warmup = max(concurrency, (min(total, 256) // concurrency) * concurrency)
    contestants = SIDES + (BASELINE_SIDES if "base" in sides else ())
    for side in contestants:
        _run_side(sides, side, concurrency, warmup, backend)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in contestants}
    order_log = []
    for index in range(pairs):
        order = contestants if index % 2 == 0 else tuple(reversed(contestants))
        order_log.append(list(order))
        for side in order:
            runs[side].append(_run_side(sides, side, concurrency, total, backend))
    cell: dict[str, Any] = {
        "concurrency": concurrency,
        "backend": backend,
        "peer_backend": "asyncio",
        "lifecycles_per_run": total,
        "warmup_lifecycles": warmup,
        "order": order_log,
        **{side: _summarise(runs[side]) for side in contestants},
    }
    for side in contestants[1:]:
        cell[f"{side}_over_peer"] = _ratios(runs[side], runs["peer"])
    if "base" in sides:
        cell["ours_over_base"] = _ratios(runs["ours"], runs["base"])
        cell["ours_blocking_over_base"] = _ratios(runs["ours_blocking"], runs["base_blocking"])
    return cell


def _ms(summary: dict[str, Any]) -> str:
    latency = summary["latency"]
    return f"{latency['p50_ms']:.2f} / {latency['p99_ms']:.2f}"


def _runs(summary: dict[str, Any]) -> str:
    return " ".join(f"{rate:,.0f}" for rate in summary["runs_per_s"])


def _table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| c | ours on | peer /s (runs) | ours /s (runs) | ours/peer | "
        "ours, blocking engine /s (runs) | blocking/peer | peer p50/p99 ms | "
        "ours p50/p99 ms | blocking p50/p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        peer, ours, slow = cell["peer"], cell["ours"], cell["ours_blocking"]
        if "ours_over_base" in cell:
            # Beside the baseline checkout: how the cells moved.
            ours_note = f" ({cell['ours_over_base']['median']:.2f}x base)"
            slow_note = f" ({cell['ours_blocking_over_base']['median']:.2f}x base)"
        else:
            ours_note = slow_note = ""
        lines.append(
            f"| {cell['concurrency']} | {cell['backend']} | "
            f"{peer['median_per_s']:,.0f} ({_runs(peer)}) | "
            f"{ours['median_per_s']:,.0f} ({_runs(ours)}) | "
            f"{cell['ours_over_peer']['median']:.2f}x{ours_note} | "
            f"{slow['median_per_s']:,.0f} ({_runs(slow)}) | "
            f"{cell['ours_blocking_over_peer']['median']:.2f}x{slow_note} | "
            f"{_ms(peer)} | {_ms(ours)} | {_ms(slow)} |"
        )
    return "\n".join(lines)


def _headlines(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for cell in cells:
        goal = GOALS[cell["concurrency"]]
        ratio = cell["ours_over_peer"]["median"]
        rows.append(
            headline(
                f"lifecycle vs SGLang 0.5.20, c={cell['concurrency']}, ours on {cell['backend']}",
                ratio,
                "x",
                goal=f">= {goal}x",
                met=ratio >= goal,
                note=(
                    f"ours {cell['ours']['median_per_s']:,.0f}/s vs peer "
                    f"{cell['peer']['median_per_s']:,.0f}/s; p99 "
                    f"{cell['ours']['latency']['p99_ms']:.2f} vs "
                    f"{cell['peer']['latency']['p99_ms']:.2f} ms; blocking engine "
                    f"{cell['ours_blocking_over_peer']['median']:.2f}x"
                ),
            )
        )
    return rows


def _plot(options: Options, cells: list[dict[str, Any]]) -> None:
    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        labels = [f"c={cell['concurrency']}\n{cell['backend']}" for cell in cells]
        xs = list(range(len(cells)))
        width = 0.38
        for offset, side, color, label in (
            (-width / 2, "ours", "#3b75af", "blocking = False"),
            (width / 2, "ours_blocking", "#e1812c", "blocking = True"),
        ):
            values = [cell[f"{side}_over_peer"]["median"] for cell in cells]
            ax.bar([x + offset for x in xs], values, width, color=color, label=label)
        for x, cell in zip(xs, cells, strict=True):
            goal = GOALS[cell["concurrency"]]
            ax.plot([x - 0.45, x + 0.45], [goal, goal], "k--", lw=1)
        ax.axhline(1.0, color="#999999", lw=1, ls=":")
        ax.set_xticks(xs, labels)
        ax.set_ylabel("ours / SGLang lifecycles per s (median of pairs)")
        ax.set_title("encode + send + release against SGLang 0.5.20 (dashed: goal)")
        ax.legend(fontsize=8, title="our no-op engine", title_fontsize=8)

    write_png(options, NAME, draw, size=(8, 4.2))


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
        return _serve_peer(PEER_DIR)
    if args.serve == "ours":
        return _serve_ours()
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
    sides: dict[str, _Side] = {}
    try:
        sides["peer"] = _Side("the SGLang peer", [str(peer_python), script, "--serve", "peer"])
        sides["ours"] = _Side("our encoder", [sys.executable, script, "--serve", "ours"])
        if args.baseline_src is not None:
            if not (args.baseline_src / "encdisagg" / "__init__.py").is_file():
                raise SystemExit(f"bench_peer: no encdisagg package in {args.baseline_src}")
            sides["base"] = _Side(
                "the baseline encoder",
                [sys.executable, script, "--serve", "ours"],
                src=args.baseline_src.resolve(),
            )
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
                cell = _cell(sides, concurrency, backend, total, args.pairs)
                cells.append(cell)
                print(_table([cell]).splitlines()[-1], flush=True)
    finally:
        for side in sides.values():
            side.close()
    print()
    print(_table(cells))
    data = {
        "settings": {
            "pairs": args.pairs,
            "lifecycles_per_run": total,
            "embedding": {"tokens": TOKENS, "hidden": HIDDEN, "dtype": "float16"},
            "peer_bench": f"{PEER_DIR_SHOWN}/bench.py run_once('full', c, n)",
            "ours": "encode + send(MooncakeDestination, no-op engine) + "
            "send(ZmqDestination, PULL sink thread) + release; default_receive_count=2",
        },
        "peer_versions": {k: v for k, v in sides["peer"].hello.items() if k != "ready"},
        "our_versions": {k: v for k, v in sides["ours"].hello.items() if k != "ready"},
        "baseline": None if args.baseline_src is None else "an earlier checkout's src, beside",
        "goals": {f"c={c}": f">= {goal}x" for c, goal in GOALS.items()},
        "cells": cells,
        "table_md": _table(cells),
        "headline": _headlines(cells),
    }
    write_json(options, NAME, data)
    _plot(options, cells)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
