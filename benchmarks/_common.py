"""Helpers shared by the benchmark scripts: options, timing, statistics, machine info, output.

Every script writes ``<out>/<name>.json`` (its figures, the machine it ran on, and a
``headline`` list the runner gathers into the summary table) and, when matplotlib is
installed, ``<out>/<name>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import selectors
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Options:
    """What every benchmark script accepts."""

    quick: bool
    out: Path
    repeats: int | None

    def pick(self, full: int, quick: int) -> int:
        return quick if self.quick else full


def parse_options(description: str, argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", type=Path, help="folder for the JSON and PNG files")
    parser.add_argument("--repeats", type=int, help="repeats per measurement")
    args = parser.parse_args(argv)
    out = args.out or (QUICK_RESULTS_DIR if args.quick else RESULTS_DIR)
    return Options(quick=args.quick, out=out, repeats=args.repeats)


# -- statistics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_summary(seconds: Sequence[float]) -> dict[str, float | int]:
    """p50, p90, p99, mean and max of latencies, in milliseconds."""
    return {
        "n": len(seconds),
        "p50_ms": percentile(seconds, 50) * 1e3,
        "p90_ms": percentile(seconds, 90) * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "mean_ms": (statistics.fmean(seconds) * 1e3) if seconds else float("nan"),
        "max_ms": (max(seconds) * 1e3) if seconds else float("nan"),
    }


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """Median, best (max) and worst (min) of repeated throughput figures."""
    return {
        "median": statistics.median(values),
        "max": max(values),
        "min": min(values),
        "repeats": len(values),
    }


@contextmanager
def stopwatch() -> Iterator[Callable[[], float]]:
    """``with stopwatch() as elapsed: ...``; ``elapsed()`` is the seconds so far / in total."""
    start = time.perf_counter()
    end: list[float] = []

    def elapsed() -> float:
        return (end[0] if end else time.perf_counter()) - start

    try:
        yield elapsed
    finally:
        end.append(time.perf_counter())


# -- machine ------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (and how busy it was when the run began)."""
    packages = (
        "encdisagg",
        "torch",
        "anyio",
        "trio",
        "pyzmq",
        "hypercorn",
        "quart",
        "httpx",
        "mooncake-transfer-engine-non-cuda",
        "mooncake-transfer-engine",
        "transformers",
    )
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": {name: v for name in packages if (v := _version(name)) is not None},
        "commit": _git_commit(),
        "loadavg_at_start": [round(x, 2) for x in load] if load else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def rss_mib(pid: int | None = None) -> float | None:
    """Resident set size of ``pid`` (this process by default), in MiB; None if unknown."""
    path = Path(f"/proc/{pid or 'self'}/status")
    try:
        for line in path.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


# -- output --------------------------------------------------------------------------------


def headline(
    figure: str,
    value: float,
    unit: str,
    *,
    goal: str | None = None,
    met: bool | None = None,
    note: str = "",
) -> dict[str, Any]:
    """One row of the summary table."""
    return {"figure": figure, "value": value, "unit": unit, "goal": goal, "met": met, "note": note}


def write_json(options: Options, name: str, data: dict[str, Any]) -> Path:
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / f"{name}.json"
    payload = {"benchmark": name, "quick": options.quick, "machine": machine_info(), **data}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
    return path


def _jsonable(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_png(
    options: Options,
    name: str,
    draw: Callable[[Any], None],
    *,
    size: tuple[float, float] = (9, 4),
) -> Path | None:
    """Draw a figure with ``draw(fig)`` and save it as ``<out>/<name>.png``.

    Skipped (with a note) when matplotlib is not installed: the JSON still holds every figure.
    """
    if not have_matplotlib():
        print(f"matplotlib is not installed: no {name}.png (install the 'bench' extra)")
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=size, dpi=110)
    try:
        draw(fig)
        fig.tight_layout()
        options.out.mkdir(parents=True, exist_ok=True)
        path = options.out / f"{name}.png"
        fig.savefig(path)
    finally:
        plt.close(fig)
    print(f"wrote {path}")
    return path


def label_bars(ax: Any, bars: Any, fmt: str = "{:.0f}") -> None:
    for bar in bars:
        height = bar.get_height()
        if height == height:  # not NaN
            ax.annotate(
                fmt.format(height),
                (bar.get_x() + bar.get_width() / 2, height),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )


def python_env() -> dict[str, str]:
    """The environment for child processes: offline model hub, this folder importable."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    paths = [str(BENCH_DIR)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def child(args: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``python <args>`` with pipes on stdin and stdout (text, line buffered)."""
    return subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=python_env(),
        **kwargs,
    )


class Server:
    """A server in a child process that prints ``... on <url>`` once it serves.

    ``with Server([...]) as server:`` starts it (bounded wait) and stops it on exit with
    SIGTERM (graceful), then SIGKILL if it does not exit in time.
    """

    def __init__(self, args: Sequence[str], *, start_timeout_s: float = 120.0) -> None:
        self.args = list(args)
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self.process: subprocess.Popen[str] | None = None
        self._log = tempfile_log()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> Server:
        import selectors

        self.process = subprocess.Popen(
            [sys.executable, *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=python_env(),
            cwd=REPO_ROOT,
        )
        assert self.process.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    break
                line = self.process.stdout.readline()
                if not line:
                    break
                if " on http" in line:
                    self.url = line.rsplit(" on ", 1)[1].strip()
                    return self
        tail = self.log_tail()
        self.__exit__(None, None, None)
        raise RuntimeError(f"the server {self.args} did not start:\n{tail}")

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        self._log.seek(0)
        return str(self._log.read())[-chars:]

    def __exit__(self, *exc: object) -> None:
        import signal

        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        if process.stdout is not None:
            process.stdout.close()
        self._log.close()


def tempfile_log() -> Any:
    import tempfile

    return tempfile.TemporaryFile(mode="w+")


# -- long-lived child processes, one JSON line per command ----------------------------------


def serve_json_lines(
    handle: Callable[[dict[str, Any]], dict[str, Any]], hello: dict[str, Any]
) -> int:
    """In a child: answer one JSON line on stdout per JSON line on stdin, until stdin closes.

    Whatever the libraries print goes to stderr: stdout is kept for the answers only. An
    exception is answered as ``{"error": traceback}``, which the harness reports.
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


class ChildSide:
    """The harness's end of a child running :func:`serve_json_lines`.

    :param name: the benchmark's name, for messages.
    :param src: a checkout's ``src`` folder, imported instead of this one's.
    """

    def __init__(
        self,
        name: str,
        label: str,
        command: Sequence[str],
        *,
        src: Path | None = None,
        start_timeout_s: float = 600.0,
        run_timeout_s: float = 600.0,
    ) -> None:
        self.name = name
        self.label = label
        self.run_timeout_s = run_timeout_s
        env = python_env()
        if src is not None:
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
        self.hello = self._answer(start_timeout_s, "start")

    def _answer(self, timeout_s: float, what: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        where = f"{self.name}: {self.label}"
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout=timeout_s):
                raise SystemExit(f"{where} did not {what} in {timeout_s:.0f} s")
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait(10)
            raise SystemExit(f"{where} exited (code {code}) during {what}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise SystemExit(f"{where} failed during {what}:\n{answer['error']}")
        return answer

    def run(self, **command: Any) -> dict[str, Any]:
        """Send one command; its answer. Blocks until the child answers."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer(self.run_timeout_s, f"run {command}")

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
