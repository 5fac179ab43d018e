"""Instructions per request lifecycle, counted by callgrind: a figure that does not swing with
the machine's speed, as the seconds of ``bench_lifecycle`` do.

Run as ``python benchmarks/bench_instructions.py [--quick]``; writes ``instructions.json``.
Needs valgrind (Debian's ``valgrind`` package); without it the script says so and writes
nothing.

Counted, each in a child process of its own:

- **the lifecycle** at one task, on asyncio and on Trio: ``bench_lifecycle``'s cell
  (``encode`` + ``send`` + ``release``; ``NullVisionModel``, ``LoopbackEngine``);
- **its floor**: the same calls made directly (``bench_lifecycle``'s raw loop);
- **three bare checkpoints** per backend, the ones the Encoder's calls await
  (``nurseries.loop_checkpoint``): what the lifecycle's three schedule points cost alone.

A child runs under ``valgrind --tool=callgrind --instr-atstart=no``: it imports and warms up
uninstrumented, then the parent switches instrumentation on (``callgrind_control -i on``) and
the child runs N operations and exits. Two children per side, of N1 and N2 operations, give
one operation's instructions as (I(N2) - I(N1)) / (N2 - N1): the Encoder's opening and
closing and the exit cancel out. The figures repeat to a fraction of a per cent between runs
on one machine, loaded or not (``PYTHONHASHSEED`` is fixed).

What callgrind does not count: time in the kernel (each pass through an event loop polls
epoll) and how fast the processor runs the instructions (interpreted code with many branches
runs fewer per cycle than the floor's torch and hashing calls). So a ratio of instructions is
not a ratio of time: it shows how much of the work is the Encoder's own, apart from those.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import BENCH_DIR, Options, headline, parse_options, python_env, write_json

#: (side, backend) pairs counted; the floor has no event loop.
SIDES = (
    ("floor", "none"),
    ("lifecycle", "asyncio"),
    ("lifecycle", "trio"),
    ("checkpoints", "asyncio"),
    ("checkpoints", "trio"),
)
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")
_CHILD_TIMEOUT_S = 1200.0


# -- the child: one side, N operations -----------------------------------------------------------


def _operations(side: str, backend: str) -> Any:
    """A function running ``n`` operations of ``side`` (checkpoints: three per operation)."""
    import anyio
    import bench_lifecycle

    if side == "floor":
        return bench_lifecycle._raw_floor

    if side == "lifecycle":

        def lifecycle(n: int) -> None:
            anyio.run(bench_lifecycle._run_cell, 1, n, f"n{n}", backend=backend)

        return lifecycle

    from encdisagg.nurseries import loop_checkpoint

    async def checkpoints(n: int) -> None:
        checkpoint = loop_checkpoint()
        for _ in range(n):
            await checkpoint()
            await checkpoint()
            await checkpoint()

    return lambda n: anyio.run(checkpoints, n, backend=backend)


def _child(side: str, backend: str, n: int) -> int:
    run = _operations(side, backend)
    run(200)  # warm-up, uninstrumented
    print(f"READY {os.getpid()}", flush=True)
    sys.stdin.readline()  # the parent's go, once instrumentation is on
    run(n)
    # Nothing after the counted run: the interpreter's teardown would be counted too.
    os._exit(0)


# -- the parent ---------------------------------------------------------------------------------


def _count(side: str, backend: str, n: int) -> int:
    """Instructions of one child: ``n`` operations plus what every child of ``side`` adds."""
    with tempfile.TemporaryDirectory(prefix="encdisagg-callgrind-") as folder:
        log = Path(folder, "valgrind.log")
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={Path(folder, 'callgrind.out')}",
            f"--log-file={log}",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            side,
            backend,
            str(n),
        ]
        env = {**python_env(), "PYTHONHASHSEED": "0"}
        with subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=BENCH_DIR,
        ) as child:
            assert child.stdin is not None
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line.startswith("READY "):
                child.kill()
                raise RuntimeError(f"{side}/{backend}: the child did not start: {line!r}")
            pid = line.split()[1]
            subprocess.run(
                ["callgrind_control", "-i", "on", pid],
                check=True,
                capture_output=True,
                timeout=60,
            )
            child.stdin.write("go\n")
            child.stdin.flush()
            try:
                child.wait(timeout=_CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                raise
        if child.returncode != 0:
            raise RuntimeError(f"{side}/{backend}: the child exited with {child.returncode}")
        found = _COLLECTED.findall(log.read_text())
        if not found:
            raise RuntimeError(f"{side}/{backend}: no instruction count in valgrind's log")
        return int(found[-1])


def _per_operation(
    counts: dict[tuple[str, str, int], int], small: int, large: int
) -> dict[str, float]:
    return {
        f"{side}/{backend}": (counts[(side, backend, large)] - counts[(side, backend, small)])
        / (large - small)
        for side, backend in SIDES
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        side, backend, n = args[1:4]
        return _child(side, backend, int(n))
    options: Options = parse_options(__doc__.splitlines()[0], args)
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"instructions: {', '.join(missing)} not found (Debian: apt-get install valgrind)")
        return 0
    small, large = (200, 600) if options.quick else (1000, 3000)
    jobs = [(side, backend, n) for side, backend in SIDES for n in (small, large)]
    # Two children at a time: each keeps one core busy while valgrind translates.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {job: pool.submit(_count, *job) for job in jobs}
        counts = {job: future.result() for job, future in futures.items()}
    per_op = _per_operation(counts, small, large)
    floor = per_op["floor/none"]
    cells = {}
    heads = []
    for backend in ("asyncio", "trio"):
        lifecycle = per_op[f"lifecycle/{backend}"]
        checkpoints = per_op[f"checkpoints/{backend}"]
        cell = {
            "lifecycle": lifecycle,
            "checkpoints": checkpoints,
            "floor": floor,
            "ratio_to_floor": floor / lifecycle,
            "ratio_to_floor_without_checkpoints": floor / (lifecycle - checkpoints),
            "checkpoint_share": checkpoints / lifecycle,
        }
        cells[backend] = cell
        print(
            f"{backend:>7}: {lifecycle:,.0f} instructions per lifecycle against {floor:,.0f} "
            f"for the floor ({cell['ratio_to_floor']:.2f}x); three checkpoints alone "
            f"{checkpoints:,.0f} ({cell['checkpoint_share']:.0%})"
        )
        heads.append(
            headline(
                f"lifecycle {backend} c=1 / raw floor, in instructions",
                cell["ratio_to_floor"],
                "x",
                note=(
                    f"{lifecycle:,.0f} vs {floor:,.0f} instructions per operation (callgrind); "
                    f"three checkpoints alone {checkpoints:,.0f}; "
                    f"{cell['ratio_to_floor_without_checkpoints']:.2f}x without them; "
                    "no kernel time or cycles counted"
                ),
            )
        )
    data = {
        "operations": [small, large],
        "counts": {f"{side}/{backend}/{n}": value for (side, backend, n), value in counts.items()},
        "per_operation": per_op,
        "cells": cells,
        "headline": heads,
    }
    write_json(options, "instructions", data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
