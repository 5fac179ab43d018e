"""``benchmarks/gpu_check.py --device cpu`` runs every step end to end and writes its rows.

The GPU check is meant for a machine with a GPU; its CPU mode runs the same steps (a
scaled-down tower, the smallest demo) so the script itself is checked on every run of the
suite, long before a GPU runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
STEPS = [
    "tests",
    "tower",
    "preprocess",
    "transfer",
    "demo zmq",
    "demo mooncake",
    "serve --dp 2, a device each",
    "serve --dp 2, one device shared",
]


@pytest.mark.skipif(not SCRIPT.exists(), reason="no benchmarks/gpu_check.py")
# About a minute and a half on two idle cores; minutes when they are shared.
@pytest.mark.timeout(600)
def test_the_cpu_run_passes_or_skips_every_step_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    # The outer pytest's variables must not reach the pytest the check starts.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "ENCDISAGG_"))}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--budget-s", "480"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=560,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["device"] == "cpu"
    assert data["ok"] is True
    rows = {row["step"]: row for row in data["rows"]}
    assert list(rows) == STEPS
    for row in rows.values():
        assert row["status"] in ("ok", "skipped"), row
        if row["status"] == "skipped":
            assert row["reason"], row
    # One table on stdout, with the same rows.
    assert all(f"| {step} | {rows[step]['status']} |" in done.stdout for step in STEPS)

    tests = rows["tests"]["figures"]
    assert tests["passed"] > 0
    assert tests["failed"] == 0
    assert "tests/encoder/test_arena.py" in tests["files"]

    tower = rows["tower"]["figures"]
    assert tower["shape"]["scaled_down"] is True
    assert {cell["image"] for cell in tower["cells"]} == {"448x448", "1280x720"}
    assert all(cell["images_per_s"] > 0 for cell in tower["cells"])

    preprocess = rows["preprocess"]["figures"]
    assert [cell["image"] for cell in preprocess["cells"]] == ["1280x720 JPEG", "1920x1080 JPEG"]
    for cell in preprocess["cells"]:
        # On the CPU the device mode is the fast mode: the same values and keys.
        assert (cell["max_abs_diff"], cell["cache_keys_equal"]) == (0.0, True)
        assert cell["host_images_per_s"] > 0
        assert cell["device_images_per_s"] > 0

    transfer = rows["transfer"]["figures"]
    assert transfer["bytes_equal"] is True
    assert [case["bytes_equal"] for case in transfer["cases"]] == [True] * 4

    for demo in ("demo zmq", "demo mooncake"):
        assert rows[demo]["figures"]["parity"] == "ok"
    assert rows["serve --dp 2, a device each"]["status"] == "skipped"
    assert sorted(rows["serve --dp 2, one device shared"]["figures"]["worker_pids"]) == ["0", "1"]
