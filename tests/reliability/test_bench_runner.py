"""The benchmark runner (``python -m benchmarks``) works end to end on a cheap subset.

The whole ``--quick`` run takes well over a minute on a CI machine, so this smoke test runs
two of its benchmarks (one of ours, one written by another team) into a temporary folder and
checks what the runner gathers: their JSON, the summary with headline figures, and a plot
when matplotlib is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    not (REPO / "benchmarks" / "__main__.py").exists(), reason="no benchmarks/ folder"
)
def test_quick_subset_writes_results_and_summary(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "benchmarks")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--quick",
            "--only",
            "lifecycle,decode",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [run["status"] for run in summary["runs"]] == ["ok", "ok"]
    assert summary["headline"]["lifecycle"], summary
    assert summary["headline"]["decode"], summary
    lifecycle = json.loads((tmp_path / "lifecycle.json").read_text())
    assert lifecycle["quick"] is True
    assert lifecycle["machine"]["cpu_count"] >= 1
    assert "| lifecycle |" in (tmp_path / "summary.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "lifecycle.png").stat().st_size > 0
