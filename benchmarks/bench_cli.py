"""How long ``encdisagg serve`` takes to answer an invalid option, a busy port or a bad file.

Run as ``python benchmarks/bench_cli.py [--quick] [--repeats N]``; writes ``cli.json``.

Each case starts ``python -m encdisagg serve`` in a fresh process (as a user would) and times
it from the start until it exits with its one-line error: ``--port notaport``, a port another
socket holds, and a config file with two bad values. The options are checked and the port
is bound before torch and the model code are imported, so each should answer in well under
a second (goal: under 1 s, median of the runs). A ``--check`` of valid options is timed too.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, headline, parse_options, python_env, spread, write_json

_GOAL_S = 1.0


def _time(argv: list[str], expected_code: int) -> tuple[float, str]:
    """Seconds from start to exit of ``encdisagg serve ARGV``, and its stderr."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "encdisagg", "serve", *argv],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )
    elapsed = time.perf_counter() - started
    if done.returncode != expected_code:
        raise RuntimeError(f"serve {argv} exited {done.returncode}: {done.stderr}")
    return elapsed, done.stderr.strip()


def main(argv: list[str] | None = None) -> None:
    options = parse_options(__doc__.splitlines()[0], argv)
    repeats = options.repeats or options.pick(7, 3)
    with tempfile.TemporaryDirectory() as folder, socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        bad_file = Path(folder) / "serve.toml"
        bad_file.write_text('[encoder]\nmax_batch_size = 0\n[server]\ndp = "two"\n')
        good_file = Path(folder) / "good.toml"
        good_file.write_text('[encoder]\nmodel = "null"\n[server]\nport = 9000\n')
        cases: dict[str, tuple[list[str], int]] = {
            "bad flag (--port notaport)": (["--port", "notaport"], 2),
            "busy port": (["--port", str(busy), "--model", "null"], 1),
            "bad config file (2 errors)": (["--config", str(bad_file)], 2),
            "--check, valid": (["--check", "--config", str(good_file)], 0),
        }
        results: dict[str, Any] = {}
        for name, (args, code) in cases.items():
            runs = []
            message = ""
            for _ in range(repeats):
                elapsed, message = _time(args, code)
                runs.append(elapsed)
            results[name] = {
                "argv": args,
                "exit": code,
                "median_s": statistics.median(runs),
                "runs_s": runs,
                "spread": spread(runs),
                "stderr": message,
            }
            print(f"{name}: median {statistics.median(runs):.3f} s over {repeats} runs")
    heads = [
        headline(
            f"serve answers: {name}",
            round(case["median_s"], 3),
            "s",
            goal=f"< {_GOAL_S:g} s",
            met=case["median_s"] < _GOAL_S,
            note=f"median of {repeats} fresh processes",
        )
        for name, case in results.items()
    ]
    write_json(options, "cli", {"repeats": repeats, "cases": results, "headline": heads})


if __name__ == "__main__":
    main()
