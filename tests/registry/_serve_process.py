"""``encdisagg serve`` processes for the registry tests, each in a process group of its own
(so killing a "host" kills everything it started) and bound to a given loopback address."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

#: Bound on a serve process's start (it imports torch and Quart).
START_TIMEOUT_S = 60.0
ANNOUNCEMENT = "encdisagg serving on "


@dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    url: str
    output: list[str] = field(default_factory=list)
    terminated: bool = False
    pump: threading.Thread | None = None

    def _closed(self) -> None:
        # The pump ends with the output; then the pipe is closed here, not by the collector.
        if self.pump is not None:
            self.pump.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def terminate(self) -> None:
        """SIGTERM once: a graceful drain (a second one would stop it at once)."""
        if not self.terminated and self.process.poll() is None:
            self.terminated = True
            self.process.send_signal(signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL the whole process group: the host is gone, nothing cleans up."""
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self._closed()

    def stop(self) -> int:
        """SIGTERM (a graceful drain); the exit status."""
        self.terminate()
        try:
            status = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill_group()
            raise
        self._closed()
        return status


def _pump(stream: object, lines: list[str], ready: threading.Event) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.append(line)
        if line.startswith(ANNOUNCEMENT):
            ready.set()
    ready.set()


def start_serve(host: str, registry: str, *extra: str, backend: str = "asyncio") -> ServeProcess:
    """Start ``encdisagg serve --model null`` on ``host`` (a free port), registered under
    ``registry`` with a 2 s lease; return once it announced its URL."""
    argv = [
        sys.executable,
        "-m",
        "encdisagg",
        "serve",
        "--model=null",
        f"--host={host}",
        "--port=0",
        f"--worker-class={backend}",
        f"--registry={registry}",
        "--registry-lease-ttl=2",
        "--log-level=warning",
        *extra,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()
    pump = threading.Thread(target=_pump, args=(process.stdout, lines, ready), daemon=True)
    pump.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.1):
        if time.monotonic() > deadline or process.poll() is not None:
            break
    url = next((line[len(ANNOUNCEMENT) :].strip() for line in lines if ANNOUNCEMENT in line), None)
    if url is None:
        ServeProcess(process, "", lines, pump=pump).kill_group()
        raise RuntimeError("serve did not start:\n" + "".join(lines[-40:]))
    return ServeProcess(process, url, lines, pump=pump)


@contextmanager
def serving(
    host: str, registry: str, *extra: str, backend: str = "asyncio"
) -> Iterator[ServeProcess]:
    server = start_serve(host, registry, *extra, backend=backend)
    try:
        yield server
    finally:
        server.kill_group()
