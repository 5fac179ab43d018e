"""One bounded check of every device path of encdisagg, for a machine with a GPU.

Run as ``python benchmarks/gpu_check.py --device cuda`` (or ``nox -s gpu``); ``--device cpu``
runs the same steps on the CPU, with a scaled-down tower, in well under two minutes. Prints
one table and writes the same rows to ``benchmarks/results/gpu_check.json``; exits 1 if a
step failed. Steps (each ``ok``, ``failed`` or ``skipped`` with its reason; a failed step
does not stop the others):

1. ``tests``: the device-marked tests (``pytest -m device``) with ``ENCDISAGG_TEST_DEVICE``;
2. ``tower``: Qwen2.5-VL-7B's vision tower (random weights) in bfloat16: images/s at
   batches of 1, 4 and 8 for 448x448 and 1280x720, preprocessing timed apart;
3. ``preprocess``: images/s of the fast image path on the host and of the same kernels on
   the device (``preprocess = "device"``) for a 1280x720 and a 1920x1080 JPEG, with the
   largest difference of their pixel values and whether their cache keys agree;
4. ``transfer``: embeddings made on the device, staged in the arena there, over Mooncake
   TCP to a receiver on this host and over ZMQ, compared byte for byte;
5. ``demo zmq`` / ``demo mooncake``: ``encdisagg demo --device`` with ``parity=ok``;
6. ``serve --dp 2``: each worker on its own GPU (skipped with fewer than two), and both
   workers on one shared device.

Every step runs in a child process with a timeout, and the whole run within ``--budget-s``
(8 minutes by default): a step that would start past the budget is skipped, saying so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, machine_info, python_env
from _gpu_common import Row, device_name, is_accelerator, parse_row, print_row, row

DEFAULT_OUT: Final = RESULTS_DIR / "gpu_check.json"
#: (name, --only group, timeout in seconds).
STEPS: Final = (
    ("tests", "tests", 180.0),
    ("tower", "tower", 150.0),
    ("preprocess", "preprocess", 60.0),
    ("transfer", "transfer", 60.0),
    ("demo zmq", "demo", 60.0),
    ("demo mooncake", "demo", 60.0),
    ("serve --dp 2, a device each", "dp", 90.0),
    ("serve --dp 2, one device shared", "dp", 90.0),
)
GROUPS: Final = ("tests", "tower", "preprocess", "transfer", "demo", "dp")
#: A step is not started with less than this left of the budget.
MIN_STEP_S: Final = 10.0


def _in_child(step: str, device: str, repeats: int, timeout_s: float) -> Row:
    """Run ``--step STEP`` of this script in a child process: its row, or a failed one."""
    started = time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--step", step]
    command += ["--device", device, "--repeats", str(repeats)]
    try:
        done = subprocess.run(
            command, env=python_env(), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return row(step, "failed", reason=f"ran past its {timeout_s:.0f} s", seconds=timeout_s)
    result = parse_row(done.stdout)
    if result is None:
        tail = " ".join((done.stdout + done.stderr)[-800:].split())
        reason = f"exit {done.returncode} without a result: {tail}"
        return row(step, "failed", reason=reason, seconds=time.perf_counter() - started)
    return result


def _run_step(name: str, device: str, repeats: int, timeout_s: float) -> Row:
    from _gpu_serve import demo_step, dp_own_step, dp_shared_step, tests_step

    runners: dict[str, Callable[[], Row]] = {
        "tests": lambda: tests_step(device, timeout_s),
        "tower": lambda: _in_child("tower", device, repeats, timeout_s),
        "preprocess": lambda: _in_child("preprocess", device, repeats, timeout_s),
        "transfer": lambda: _in_child("transfer", device, repeats, timeout_s),
        "demo zmq": lambda: demo_step(device, "zmq", timeout_s),
        "demo mooncake": lambda: demo_step(device, "mooncake", timeout_s),
        "serve --dp 2, a device each": lambda: dp_own_step(device, timeout_s),
        "serve --dp 2, one device shared": lambda: dp_shared_step(device, timeout_s),
    }
    try:
        return runners[name]()
    except Exception as exc:  # one step's surprise must not end the table
        return row(name, "failed", reason=f"{type(exc).__name__}: {exc}")


def run_all(
    device: str, groups: Sequence[str], budget_s: float, repeats: int, jobs: int = 1
) -> list[Row]:
    """Every step of ``groups``, each bounded by its timeout and what is left of
    ``budget_s`` when it starts, ``jobs`` at a time (rows in step order); prints each
    row's line as it ends. On the CPU, steps check the path, not the figures: their
    timeouts are doubled (a shared two-core machine is slow to start processes)."""
    started = time.perf_counter()
    scale = 1.0 if is_accelerator(device) else 2.0

    def one(name: str, timeout_s: float) -> Row:
        left = budget_s - (time.perf_counter() - started)
        if left < MIN_STEP_S:
            result = row(name, "skipped", reason=f"the {budget_s:.0f} s budget is spent")
        else:
            result = _run_step(name, device, repeats, min(timeout_s * scale, left))
        print(f"  {result['step']}: {result['status']} ({result['seconds']} s)", flush=True)
        return result

    chosen = [(name, timeout_s) for name, group, timeout_s in STEPS if group in groups]
    # Each step is a child process (or a few): threads here only wait for them.
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(one, name, timeout_s) for name, timeout_s in chosen]
        return [future.result() for future in futures]


# -- the table -------------------------------------------------------------------------------


def _tower_text(figures: dict[str, Any]) -> str:
    shape = figures["shape"]
    parts = [
        f"depth {shape['depth']}, width {shape['hidden_size']}, {shape['dtype']}"
        + (" (scaled down)" if shape["scaled_down"] else "")
        + f", {shape['parameters'] / 1e6:.1f} M parameters, built in {figures['build_s']} s"
    ]
    for image in ("448x448", "1280x720"):
        cells = [cell for cell in figures["cells"] if cell["image"] == image]
        if cells:
            rates = ", ".join(f"b{c['batch']} {c['images_per_s']}" for c in cells)
            parts.append(
                f"{image}: {rates} images/s (forward); "
                f"preprocess {cells[0]['preprocess_ms_per_image']} ms/image"
            )
    return "; ".join(parts)


def summary(result: Row) -> str:
    """One line of what a row found: its reason if not ok, else its headline figures."""
    figures = result["figures"]
    if result["status"] != "ok" or not figures:
        return str(result["reason"])
    step = result["step"]
    if step == "tests":
        return (
            f"{figures['passed']} passed, {figures['failed']} failed, "
            f"{figures['skipped']} skipped in {len(figures['files'])} files"
        )
    if step == "tower":
        return _tower_text(figures)
    if step == "preprocess":
        return "; ".join(
            f"{cell['image']}: host {cell['host_images_per_s']}/s, device "
            f"{cell['device_images_per_s']}/s ({cell['device_vs_host']}x), max diff "
            f"{cell['max_abs_diff']}, keys equal {'yes' if cell['cache_keys_equal'] else 'no'}"
            for cell in figures["cells"]
        )
    if step == "transfer":
        return "; ".join(
            f"{case['case']}: {case['bytes'] / 2**20:.1f} MiB, bytes equal "
            f"{'yes' if case['bytes_equal'] else 'NO'}, {case['gb_per_s']} GB/s"
            for case in figures["cases"]
        )
    if step.startswith("demo"):
        return (
            f"parity={figures.get('parity')}, {figures.get('completed')}/"
            f"{figures.get('requests')} completed, ttft_p50 {figures.get('ttft_p50')}"
        )
    placed = figures.get("placed")
    return f"workers {figures.get('worker_pids')}" + (f" on {placed}" if placed else "")


def table(rows: Sequence[Row]) -> str:
    lines = ["| step | status | seconds | figures / reason |", "|---|---|---|---|"]
    for result in rows:
        text = summary(result).replace("|", "/")
        lines.append(f"| {result['step']} | {result['status']} | {result['seconds']} | {text} |")
    return "\n".join(lines)


def write_json(
    path: Path, device: str, budget_s: float, rows: Sequence[Row], elapsed: float
) -> None:
    payload = {
        "benchmark": "gpu_check",
        "device": device,
        "device_name": device_name(device),
        "budget_s": budget_s,
        "elapsed_s": round(elapsed, 1),
        "ok": all(result["status"] != "failed" for result in rows),
        "machine": machine_info(),
        "rows": list(rows),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:1, cpu...")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file")
    parser.add_argument("--budget-s", type=float, default=480.0, help="whole run (480)")
    parser.add_argument("--only", help=f"comma-separated groups of {', '.join(GROUPS)}")
    parser.add_argument(
        "--repeats", type=int, help="timed repeats per tower figure (3 on a GPU, 1 on the CPU)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        help="steps run at once (1 on a GPU, so figures are not disturbed; 2 on the CPU)",
    )
    parser.add_argument("--step", help=argparse.SUPPRESS)  # one step, in a child process
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    repeats = args.repeats or (3 if is_accelerator(args.device) else 1)
    if args.step:
        from _gpu_preprocess import preprocess_step
        from _gpu_tower import tower_step
        from _gpu_transfer import transfer_step

        steps: dict[str, Callable[[], Row]] = {
            "tower": lambda: tower_step(args.device, repeats),
            "preprocess": lambda: preprocess_step(args.device, repeats),
            "transfer": lambda: transfer_step(args.device),
        }
        try:
            result = steps[args.step]()
        except Exception as exc:  # reported as the step's row, with what went wrong
            result = row(args.step, "failed", reason=f"{type(exc).__name__}: {exc}")
        print_row(result)
        return 0
    groups = GROUPS if not args.only else tuple(g.strip() for g in args.only.split(","))
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        print(f"gpu_check: unknown --only {unknown}; choose from {', '.join(GROUPS)}")
        return 2
    print(f"gpu_check on {args.device} ({device_name(args.device)}), budget {args.budget_s} s")
    started = time.perf_counter()
    jobs = args.jobs or (1 if is_accelerator(args.device) else 2)
    rows = run_all(args.device, groups, args.budget_s, repeats, jobs)
    elapsed = time.perf_counter() - started
    print()
    print(table(rows))
    print(f"\n{len(rows)} steps in {elapsed:.0f} s on {args.device}")
    write_json(args.out, args.device, args.budget_s, rows, elapsed)
    print(f"wrote {args.out}")
    return 1 if any(result["status"] == "failed" for result in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
