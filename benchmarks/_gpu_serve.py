"""The steps of ``gpu_check.py`` that run encdisagg's own commands in child processes: the
device-marked tests, ``encdisagg demo`` on the device, and ``encdisagg serve --dp 2``.

Each is bounded by the timeout the runner gives it; a child that outlives it is killed and
the step fails, naming the timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Final

from _common import REPO_ROOT, Server, python_env
from _gpu_common import Row, cuda_count, is_accelerator, row

#: The marker of the tests that run on ``ENCDISAGG_TEST_DEVICE``.
MARKER: Final = "device"
DEVICE_ENV: Final = "ENCDISAGG_TEST_DEVICE"
_READY: Final = re.compile(r"data-parallel worker (\d+) \(pid (\d+)\) is ready")


def marked_test_files(root: Path = REPO_ROOT / "tests") -> list[str]:
    """Test files that mark tests with the device marker: pytest collects only these (the
    whole suite's collection would cost more than the tests)."""
    needle = f"pytest.mark.{MARKER}"
    return sorted(
        str(path.relative_to(REPO_ROOT))
        for path in root.rglob("test_*.py")
        if needle in path.read_text(encoding="utf-8")
    )


def _tail(text: str, chars: int = 600) -> str:
    return " ".join(text[-chars:].split())


def tests_step(device: str, timeout_s: float) -> Row:
    """``pytest -m device`` over the marked files, with the tests' device set to ``device``."""
    started = time.perf_counter()
    files = marked_test_files()
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-m", MARKER, "-q", "-p", "no:cacheprovider"]
        command += ["--junitxml", str(report), *files]
        env = {**python_env(), DEVICE_ENV: device}
        try:
            done = subprocess.run(
                command,
                cwd=REPO_ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return row(
                "tests",
                "failed",
                reason=f"pytest ran past its {timeout_s:.0f} s",
                seconds=time.perf_counter() - started,
            )
        counts = _junit_counts(report) if report.exists() else {}
    figures: dict[str, Any] = {"device": device, "files": files, **counts}
    elapsed = time.perf_counter() - started
    if done.returncode != 0 or not counts.get("passed"):
        reason = f"pytest exited {done.returncode}: {_tail(done.stdout + done.stderr)}"
        return row("tests", "failed", reason=reason, seconds=elapsed, figures=figures)
    return row("tests", "ok", seconds=elapsed, figures=figures)


def _junit_counts(report: Path) -> dict[str, int]:
    root = ElementTree.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "skipped")}
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    return {
        "passed": total["tests"] - total["skipped"] - failed,
        "failed": failed,
        "skipped": total["skipped"],
    }


def demo_step(device: str, transfer: str, timeout_s: float) -> Row:
    """``encdisagg demo --device DEVICE --transfer TRANSFER``: ok when it exits 0 and its
    summary line says ``parity=ok``."""
    step = f"demo {transfer}"
    started = time.perf_counter()
    command = [sys.executable, "-m", "encdisagg", "demo", "--device", device]
    command += ["--transfer", transfer, "--quiet"]
    if not is_accelerator(device):
        # The CPU run checks the path, not the figures: the smallest pipeline.
        command += ["--requests", "4", "--encoders", "1"]
    try:
        done = subprocess.run(
            command,
            cwd=REPO_ROOT,
            env=python_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return row(step, "failed", reason=f"ran past its {timeout_s:.0f} s")
    elapsed = time.perf_counter() - started
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    fields = dict(item.split("=", 1) for item in summary.split() if "=" in item)
    keep = ("requests", "completed", "failed", "ttft_p50", "tpot_p50", "elapsed", "parity")
    figures = {"device": device, **{key: fields[key] for key in keep if key in fields}}
    if done.returncode != 0 or fields.get("parity") != "ok":
        reason = f"exit {done.returncode}, {summary or _tail(done.stderr)}"
        return row(step, "failed", reason=reason, seconds=elapsed, figures=figures)
    return row(step, "ok", seconds=elapsed, figures=figures)


def dp_own_step(device: str, timeout_s: float) -> Row:
    """``serve --dp 2 --device cuda``: each worker on its own GPU (skipped with fewer)."""
    step = "serve --dp 2, a device each"
    if not device.startswith("cuda"):
        return row(step, "skipped", reason=f"needs two CUDA devices; running on {device}")
    count = cuda_count()
    if count < 2:
        return row(step, "skipped", reason=f"needs two CUDA devices; {count} visible")
    return _dp_step(step, ["--device", "cuda"], ["cuda:0", "cuda:1"], timeout_s)


def dp_shared_step(device: str, timeout_s: float) -> Row:
    """``serve --dp 2 --devices D,D``: both workers start on the one device they share."""
    # A bare "cuda" is device 0: the name nvidia-smi's answer is compared with.
    one = "cuda:0" if device == "cuda" else device if is_accelerator(device) else "cpu"
    devices = [one, one]
    flags = ["--device", device, "--devices", ",".join(devices)]
    return _dp_step("serve --dp 2, one device shared", flags, devices, timeout_s)


def _dp_step(step: str, flags: list[str], expected: list[str], timeout_s: float) -> Row:
    """Start ``encdisagg serve --dp 2`` with ``flags``, read each worker's pid from its
    ready line, ask ``/health``, and on CUDA check with ``nvidia-smi`` that each worker's
    process holds memory on the GPU of its rank in ``expected``."""
    import httpx

    started = time.perf_counter()
    args = ["-m", "encdisagg", "serve", "--model", "tiny", "--port", "0", "--dp", "2", *flags]
    figures: dict[str, Any] = {"expected": expected}
    try:
        with Server([*args, "--log-level", "info"], start_timeout_s=timeout_s) as server:
            health = httpx.get(f"{server.url}/health", timeout=timeout_s)
            figures["health"] = health.status_code
            log = server.log_tail(200_000)
            pids = {int(rank): int(pid) for rank, pid in _READY.findall(log)}
            figures["worker_pids"] = pids
            placed = _gpus_of(pids, expected) if expected[0].startswith("cuda") else None
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        return row(step, "failed", reason=_tail(str(exc)), seconds=time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    problems = []
    if sorted(pids) != [0, 1]:
        problems.append(f"ready lines for ranks {sorted(pids)}, not [0, 1]")
    if health.status_code != 200:
        problems.append(f"/health answered {health.status_code}")
    if placed is not None:
        figures["placed"] = placed
        wrong = {rank: got for rank, got in placed.items() if got != expected[rank]}
        if wrong:
            problems.append(f"workers not on their devices: {wrong}")
    if problems:
        return row(step, "failed", reason="; ".join(problems), seconds=elapsed, figures=figures)
    return row(step, "ok", seconds=elapsed, figures=figures)


def _gpus_of(pids: dict[int, int], expected: list[str]) -> dict[int, str]:
    """Which CUDA device each worker's process holds memory on, by GPU UUID (so the answer
    does not depend on CUDA_VISIBLE_DEVICES' numbering); ``"none"`` if nvidia-smi lists
    the process on no GPU, ``"unknown"`` without nvidia-smi."""
    import torch

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return dict.fromkeys(pids, "unknown")
    uuids = {
        f"GPU-{torch.cuda.get_device_properties(index).uuid}": f"cuda:{index}"
        for index in range(cuda_count())
    }
    done = subprocess.run(
        [smi, "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=dict(os.environ),
    )
    where: dict[int, str] = {}
    for line in done.stdout.splitlines():
        pid_text, _, uuid = (part.strip() for part in line.partition(","))
        if pid_text.isdigit():
            where[int(pid_text)] = uuids.get(uuid, uuid)
    return {rank: where.get(pid, "none") for rank, pid in pids.items()}
