"""Real ``encdisagg serve`` processes for the drain and supervision tests: the null model on
a free loopback port, their output collected line by line, waits on that output and on HTTP
answers (each re-checked on every new line or answer, bounded, never a bare sleep)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import anyio
import anyio.to_thread
import httpx
import torch

from encdisagg import Modality
from encdisagg.models import NullVisionModel

ANNOUNCEMENT = "encdisagg serving on "
#: Bound on a serve process's start (it imports torch and Quart; --dp starts workers too).
START_S = 90.0
#: Bound on each wait for the server to reach a state.
WAIT_S = 30.0
MODEL = NullVisionModel()


def expected(item: str) -> torch.Tensor:
    """What the null model makes of one image item."""
    return torch.cat(MODEL.forward([MODEL.preprocess([item], Modality.IMAGE)]))


class Serve:
    """One ``encdisagg serve`` process and the lines it printed (stdout and stderr)."""

    def __init__(self, *flags: str, worker_class: str) -> None:
        argv = [
            sys.executable,
            "-m",
            "encdisagg",
            "serve",
            "--model=null",
            "--port=0",
            f"--worker-class={worker_class}",
            "--log-level=info",
            *flags,
        ]
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()
        announced = self.wait_line(lambda line: line.startswith(ANNOUNCEMENT), START_S)
        self.url = announced[len(ANNOUNCEMENT) :].strip()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_line(self, matches: Callable[[str], bool], timeout_s: float = WAIT_S) -> str:
        """The first line ``matches`` accepts, waiting (blocking) for it."""
        with self._changed:
            found = self._changed.wait_for(
                lambda: any(matches(line) for line in self.lines) or not self._pump.is_alive(),
                timeout=timeout_s,
            )
            hit = next((line for line in self.lines if matches(line)), None)
        if not found or hit is None:
            raise AssertionError(f"serve did not print the line awaited:\n{self.output[-4000:]}")
        return hit

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    def wait_exit(self) -> int:
        """The exit status, waiting for it (blocking)."""
        status = self.process.wait(timeout=WAIT_S * 2)
        self._pump.join(timeout=10)
        return status

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self._pump.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()


@contextmanager
def serving(*flags: str, worker_class: str) -> Iterator[Serve]:
    server = Serve(*flags, worker_class=worker_class)
    try:
        yield server
    finally:
        server.kill()


async def start(*flags: str, worker_class: str) -> Serve:
    return await anyio.to_thread.run_sync(lambda: Serve(*flags, worker_class=worker_class))


async def wait_status(
    http: httpx.AsyncClient, path: str, status: int, timeout_s: float = WAIT_S
) -> httpx.Response:
    """GET ``path`` until it answers ``status``; the answer."""
    with anyio.fail_after(timeout_s):
        while True:
            response = await http.get(path)
            if response.status_code == status:
                return response
            await anyio.sleep(0.02)


async def gauge(http: httpx.AsyncClient, name: str) -> float:
    """The value of an unlabelled gauge in the server's /metrics."""
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


async def encode(http: httpx.AsyncClient, req_id: str) -> httpx.Response:
    return await http.post(
        "/encode", json={"req_id": req_id, "mm_items": [f"item-{req_id}"], "modality": "image"}
    )
