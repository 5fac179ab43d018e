"""The shell commands of docs/server.md, run as written against a real ``encdisagg serve``
(only the ports are swapped for free ones)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from ..registry._etcd_server import free_port

DOCS = Path(__file__).parents[2] / "docs" / "server.md"
SECTION = "## Trying the data path from a shell"
#: Bound on the server's start and on each command.
TIMEOUT_S = 90


def _blocks() -> tuple[list[str], list[str]]:
    """The section's command block and its printed-output block, as lines."""
    text = DOCS.read_text()
    section = text[text.index(SECTION) :]
    commands, printed = re.findall(r"```(?:bash)?\n(.*?)```", section, re.S)[:2]
    return commands.strip().splitlines(), printed.strip().splitlines()


def _argv(line: str, ports: dict[str, str]) -> tuple[list[str], bool]:
    background = line.rstrip().endswith("&")
    line = line.rstrip().removesuffix("&")
    for written, free in ports.items():
        line = line.replace(written, free)
    words = shlex.split(line)
    assert words[0] == "encdisagg"
    return [sys.executable, "-m", "encdisagg", *words[1:]], background


@pytest.fixture
def in_folder_with_media(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)).save(tmp_path / "cat.png")
    Image.fromarray(rng.integers(0, 256, (200, 100, 3), dtype=np.uint8)).save(tmp_path / "dog.jpg")
    return tmp_path


def _wait_ready(url: str, server: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, "the server exited before it was ready"
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a process we do not control: no event to wait on
    raise AssertionError("the server did not become ready")


def test_the_shell_commands_of_the_docs_run_as_written(in_folder_with_media: Path) -> None:
    commands, printed = _blocks()
    http_port, zmq_port = free_port(), free_port()
    ports = {"8000": str(http_port), "5555": str(zmq_port)}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    background: list[subprocess.Popen[str]] = []
    outputs: list[str] = []
    try:
        for line in commands:
            argv, in_background = _argv(line, ports)
            if in_background:
                process = subprocess.Popen(
                    argv, cwd=in_folder_with_media, env=env, text=True,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                )  # fmt: skip
                background.append(process)
                if argv[3] == "serve":
                    _wait_ready(f"http://127.0.0.1:{http_port}", process)
                else:
                    assert process.stdout is not None
                    first = process.stdout.readline()  # bound: it prints this on binding
                    assert first.startswith("receiving on tcp://127.0.0.1:")
                    outputs.append(first)
                continue
            done = subprocess.run(
                argv, cwd=in_folder_with_media, env=env, text=True,
                capture_output=True, timeout=TIMEOUT_S,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            outputs.append(done.stdout)
        receiver = background[1]
        rest, _ = receiver.communicate(timeout=TIMEOUT_S)
        assert receiver.returncode == 0
        outputs.append(rest)
    finally:
        for process in background:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.communicate(timeout=TIMEOUT_S)
    seen = "".join(outputs)
    # The lines that do not change from run to run are printed as the docs show them.
    for expected in printed:
        if expected.startswith(("cat.png", "dog.jpg", "latency histogram")):
            assert expected in seen.splitlines()
    sent = re.search(r"^(cli-[0-9a-f]+#0): 24 x 64 \(6144 bytes\), sent to tcp://", seen, re.M)
    assert sent is not None, seen
    assert f"req_id={sent[1]}  part=1/1  modality=image  shape=[24,64]" in seen
    pushed = re.search(rf"req_id={re.escape(sent[1])} .* sha256=([0-9a-f]+)$", seen, re.M)
    assert pushed is not None, seen
    # Kept, then fetched over Mooncake: the same bytes as the ZMQ push of the same image.
    assert "kept#0: 24 x 64 (6144 bytes), kept: encdisagg receive --from" in seen
    assert f"req_id=kept#0  shape=[24,64]  bytes=6144  tokens=[24]  sha256={pushed[1]}" in seen
    assert re.search(r"^requests=40 ok=40 errors=0 ", seen, re.M), seen
    assert (in_folder_with_media / "latency.svg").read_text().startswith("<svg")
