"""Three encoder hosts and one prefill host, each a process group bound to its own loopback
address (127.0.0.2 to 127.0.0.5), with etcd the only service they share.

Requests flow through the fleet; one encoder host is killed mid-run (SIGKILL to its whole
process group) and every request still completes, byte-exact, on the others; a new host
joins mid-run and takes load within seconds. The encoder hosts and the prefill mix asyncio
and Trio, so one run covers both backends.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from tests.registry._etcd_server import EtcdServer, needs_etcd, run_etcd
from tests.registry._serve_process import ServeProcess, start_serve

pytestmark = [needs_etcd]

PREFILL = Path(__file__).with_name("fleet_prefill.py")
REPO = Path(__file__).resolve().parents[2]
ENCODER_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
PREFILL_HOST = "127.0.0.5"
#: Bound on each wait for the run to reach a stage (all of it takes about 20 s here).
STAGE_S = 60.0


def _can_bind(host: str) -> bool:
    try:
        with socket.socket() as sock:
            sock.bind((host, 0))
    except OSError:
        return False
    return True


class Prefill:
    """The prefill process, its output lines, and waits on them."""

    def __init__(self, registry: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(PREFILL),
                f"--registry={registry}",
                f"--host={PREFILL_HOST}",
                "--concurrency=4",
                "--backend=trio",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            start_new_session=True,
        )
        self.records: list[dict[str, object]] = []
        self.other: list[str] = []
        self._changed = threading.Condition()
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                try:
                    self.records.append(json.loads(line))
                except ValueError:
                    self.other.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def completed(self) -> int:
        return sum(1 for r in self.records if r.get("ok") is True)

    def wait(self, condition: Callable[[], bool], what: str) -> None:
        with self._changed:
            ok = self._changed.wait_for(
                lambda: condition() or self.process.poll() is not None, timeout=STAGE_S
            )
        if not ok or not condition():
            tail = "".join(self.other[-30:])
            raise AssertionError(f"the run did not reach: {what}\n{self.records[-5:]}\n{tail}")

    def stop(self) -> dict[str, object]:
        assert self.process.stdin is not None
        self.process.stdin.write("stop\n")
        self.process.stdin.close()
        self.process.wait(timeout=STAGE_S)
        self._pump.join(timeout=10)
        assert self.process.stdout is not None
        self.process.stdout.close()
        done = [r for r in self.records if r.get("event") == "done"]
        assert done, "".join(self.other[-30:])
        return done[0]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._pump.join(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None and not stream.closed:
                stream.close()


def encodes(server: ServeProcess) -> int:
    """The requests the encoder counted (its /metrics), or -1 if it does not answer."""
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return -1
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("encdisagg_requests_total{")
    )


@contextmanager
def etcd_for_fleet() -> Iterator[EtcdServer]:
    with run_etcd() as server:
        yield server


def test_the_fleet_survives_a_host_loss_and_takes_in_a_new_host() -> None:
    missing = [h for h in (*ENCODER_HOSTS, PREFILL_HOST) if not _can_bind(h)]
    if missing:
        pytest.skip(f"cannot bind loopback addresses {missing}")
    with etcd_for_fleet() as etcd, ExitStack() as stack:
        registry = etcd.registry()
        backends = ("asyncio", "trio", "asyncio")
        with ThreadPoolExecutor(3) as pool:
            hosts = list(
                pool.map(
                    lambda args: start_serve(args[0], registry, backend=args[1]),
                    zip(ENCODER_HOSTS, backends, strict=True),
                )
            )
        for host in hosts:
            stack.callback(host.kill_group)
        prefill = Prefill(registry)
        stack.callback(prefill.kill)
        prefill.wait(lambda: prefill.completed() >= 30, "30 requests over three hosts")
        assert all(encodes(host) > 0 for host in hosts)

        # One host dies with everything it started: no drain, no withdrawal.
        victim = hosts[1]
        victim.kill_group()
        at_kill = prefill.completed()
        prefill.wait(lambda: prefill.completed() >= at_kill + 60, "60 requests after the loss")

        # A new host joins (on the lost host's address) and takes load within seconds.
        newcomer = start_serve(ENCODER_HOSTS[1], registry, backend="trio")
        stack.callback(newcomer.kill_group)
        joined = time.monotonic()
        at_join = prefill.completed()
        prefill.wait(
            lambda: prefill.completed() >= at_join + 20 and encodes(newcomer) > 0,
            "the new host taking load",
        )
        assert time.monotonic() - joined < STAGE_S

        done = prefill.stop()
        requests = [r for r in prefill.records if "rid" in r]
        failed = [r for r in requests if r.get("ok") is not True]
        assert failed == []
        assert all(r.get("exact") is True for r in requests)
        assert done["failed"] == 0
        assert done["completed"] == len(requests)
        assert encodes(hosts[0]) > 0
        assert encodes(hosts[2]) > 0
