"""A real etcd server for tests: loopback only, a temporary data dir, free ports, bounded.

Tests that need it skip when Debian's ``etcd-server`` package (``/usr/bin/etcd``) is not
installed; CI installs it.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
SKIP_REASON = "needs an etcd server binary: install Debian's etcd-server package"
#: Bound on etcd's start (it is ready in about a second here).
START_TIMEOUT_S = 20.0

needs_etcd = pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class EtcdServer:
    host: str
    port: int
    argv: list[str]
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def registry(self, prefix: str | None = None) -> str:
        """An ``etcd://`` URL with a prefix of its own (a fresh one unless given)."""
        prefix = prefix or f"/test-{uuid.uuid4().hex[:12]}/"
        return f"etcd://{self.endpoint}{prefix}"

    def answers(self) -> bool:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=1.0)
        try:
            connection.request("GET", "/version")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def start(self) -> None:
        """Start (or start again, on the same ports and data) and wait until it answers."""
        log = open(self.data_dir / "etcd.log", "ab")  # noqa: SIM115 - closed below
        try:
            self.process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                text = (self.data_dir / "etcd.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"etcd did not start: {text}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 10 s)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextmanager
def run_etcd(host: str = "127.0.0.1") -> Iterator[EtcdServer]:
    """Start etcd on ``host`` (free client and peer ports) for the block; stop it after."""
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    with tempfile.TemporaryDirectory(prefix="encdisagg-etcd-") as tmp:
        client, peer = free_port(host), free_port(host)
        client_url, peer_url = f"http://{host}:{client}", f"http://{host}:{peer}"
        argv = [
            ETCD,
            "--name=test",
            f"--data-dir={tmp}/data",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=test={peer_url}",
            "--log-level=error",
        ]
        server = EtcdServer(host, client, argv, Path(tmp))
        server.start()
        try:
            yield server
        finally:
            server.stop()
