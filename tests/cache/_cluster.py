"""A real Mooncake Store on loopback for the tests: ``mooncake_master`` with its built-in HTTP
metadata server, plus one ``mooncake_client`` process that lends the store its memory.

The encoders under test are pure clients (``segment_mb=0``): the entries live in the
storage process, and an encoder leaves the store in well under a second even when the
master is gone (a client that lent memory spends many seconds trying to take it back).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

LOOPBACK = "127.0.0.1"
STORAGE_MB = 256


def find_binary(name: str) -> str:
    """``name`` on PATH or next to this Python; fails the test (never skips) if absent."""
    found = shutil.which(name)
    if found is None:
        beside = Path(sys.executable).parent / name
        if beside.is_file():
            found = str(beside)
    if found is None:
        pytest.fail(
            f"{name} was not found on PATH or next to {Path(sys.executable).name}; the global "
            "cache tests need a real Mooncake Store: install encdisagg's mooncake-cpu extra "
            "(mooncake-transfer-engine-non-cuda) and the system library libibverbs1"
        )
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{what} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            socket.create_connection((LOOPBACK, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    pytest.fail(f"{what} did not listen on {LOOPBACK}:{port} within 30 s")


@contextmanager
def _process(argv: list[str], log: Path, what: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, process, log, what)
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@dataclass
class Cluster:
    """One master and one storage process; ``url`` is the encoders' ``global_cache``."""

    rpc_port: int
    metadata_port: int
    master: subprocess.Popen[bytes]
    storage: subprocess.Popen[bytes]

    @property
    def metadata(self) -> str:
        return f"http://{LOOPBACK}:{self.metadata_port}/metadata"

    def url(self, **params: object) -> str:
        query = {"metadata": self.metadata, "segment_mb": 0, "buffer_mb": 32, **params}
        text = "&".join(f"{name}={value}" for name, value in query.items())
        return f"mooncake://{LOOPBACK}:{self.rpc_port}?{text}"

    def kill_master(self) -> None:
        self.master.kill()
        self.master.wait(timeout=30)


@contextmanager
def run_cluster(logs: Path) -> Iterator[Cluster]:
    """Start a master and a storage process on loopback; kill and reap both at exit."""
    master_bin = find_binary("mooncake_master")
    client_bin = find_binary("mooncake_client")
    rpc, metadata, metrics, storage_port = (free_port() for _ in range(4))
    with ExitStack() as stack:
        master = stack.enter_context(
            _process(
                [
                    master_bin,
                    f"--rpc_address={LOOPBACK}",
                    f"--rpc_port={rpc}",
                    "--enable_http_metadata_server=true",
                    f"--http_metadata_server_host={LOOPBACK}",
                    f"--http_metadata_server_port={metadata}",
                    f"--metrics_host={LOOPBACK}",
                    f"--metrics_port={metrics}",
                ],
                logs / "mooncake_master.log",
                "mooncake_master",
                rpc,
            )
        )
        wait_for_port(metadata, master, logs / "mooncake_master.log", "the metadata server")
        storage = stack.enter_context(
            _process(
                [
                    client_bin,
                    f"--host={LOOPBACK}",
                    f"--port={storage_port}",
                    f"--global_segment_size={STORAGE_MB}MB",
                    f"--master_server_address={LOOPBACK}:{rpc}",
                    f"--metadata_server=http://{LOOPBACK}:{metadata}/metadata",
                    "--protocol=tcp",
                ],
                logs / "mooncake_client.log",
                "mooncake_client",
                storage_port,
            )
        )
        yield Cluster(rpc, metadata, master, storage)
