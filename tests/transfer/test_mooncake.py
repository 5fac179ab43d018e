"""MooncakeEngine: real transfers between two processes over TCP, and its error mapping.

Mooncake is installed wherever these tests run: a failing import fails them, it never
skips them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

from encdisagg import TransferError
from encdisagg.nurseries import run_thread_to_completion
from encdisagg.transfer import MooncakeEngine
from encdisagg.transfer._mooncake import _engine as _mooncake

pytestmark = [pytest.mark.anyio, pytest.mark.mooncake]

PEER = Path(__file__).with_name("_mooncake_peer.py")


async def _read_json(lines: BufferedByteReceiveStream) -> Any:
    return json.loads(await lines.receive_until(b"\n", 1 << 16))


async def test_two_processes_move_a_buffer_over_tcp(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], tmp_path: Path
) -> None:
    sender, _ = mooncake_pair
    nbytes = 8 << 20
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    expected = hashlib.sha256(source.numpy().tobytes()).hexdigest()
    stderr_path = tmp_path / "peer.stderr"
    sender.register(source.data_ptr(), nbytes)
    try:
        with anyio.fail_after(60), stderr_path.open("wb") as stderr:
            process = await anyio.open_process(
                [sys.executable, str(PEER), str(nbytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
            async with process:
                assert process.stdin is not None
                assert process.stdout is not None
                lines = BufferedByteReceiveStream(process.stdout)
                peer = await _read_json(lines)
                session, remote = peer["session_id"], peer["ptr"]
                assert re.fullmatch(r"127\.0\.0\.1:\d+", session)

                await run_thread_to_completion(
                    sender.write, session, source.data_ptr(), remote, nbytes
                )
                # One byte past the peer's registered buffer: refused by the peer.
                with pytest.raises(TransferError, match=r"\(rc=-?\d+\)"):
                    await run_thread_to_completion(
                        sender.write, session, source.data_ptr(), remote + 1, nbytes
                    )
                await process.stdin.send(b"digest\n")
                assert await _read_json(lines) == {"sha256": expected}, stderr_path.read_text()

                await process.stdin.send(b"exit\n")
                assert await _read_json(lines) == {"regions_after_exit": 0}
                assert await process.wait() == 0, stderr_path.read_text()

            # The peer is gone: its session is dead.
            dead = re.escape(f"mooncake write to {session} failed (")
            with pytest.raises(TransferError, match=dead):
                await run_thread_to_completion(
                    sender.write, session, source.data_ptr(), remote, 4096
                )
    finally:
        sender.deregister(source.data_ptr())


async def test_lifecycle_and_exit_deregisters_leftovers() -> None:
    engine = MooncakeEngine()
    buffer = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(TransferError, match="not started"):
        _ = engine.session_id
    async with engine as entered:
        assert entered is engine
        assert re.fullmatch(r"127\.0\.0\.1:\d+", engine.session_id)
        engine.register(buffer.data_ptr(), 4096)
        assert engine.registered_regions() == 1
    assert engine.registered_regions() == 0
    with pytest.raises(TransferError, match="register_memory: the MooncakeEngine is closed"):
        engine.register(buffer.data_ptr(), 4096)
    with pytest.raises(TransferError, match="starts once"):
        async with engine:
            pass


class FakeMooncake:
    """Scripted stand-in for ``mooncake.engine.TransferEngine`` (rc codes, no raising)."""

    def __init__(self) -> None:
        self.rc: dict[str, list[int]] = {}
        self.calls: list[tuple[object, ...]] = []
        self.block_initialize: tuple[threading.Event, threading.Event] | None = None

    def _rc(self, name: str, *args: object) -> int:
        self.calls.append((name, *args))
        script = self.rc.get(name)
        return script.pop(0) if script else 0

    def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
        if self.block_initialize is not None:
            started, release = self.block_initialize
            started.set()
            release.wait(timeout=60)
        return self._rc("initialize", hostname, metadata, protocol, device)

    def get_rpc_port(self) -> int:
        return 15000

    def register_memory(self, ptr: int, nbytes: int) -> int:
        return self._rc("register_memory", ptr, nbytes)

    def unregister_memory(self, ptr: int) -> int:
        return self._rc("unregister_memory", ptr)

    def transfer_submit_write(self, target: str, local: int, remote: int, nbytes: int) -> int:
        self.calls.append(("transfer_submit_write", target, local, remote, nbytes))
        return 0x77

    def transfer_check_status(self, batch: int) -> int:
        script = self.rc.get("transfer_check_status")
        return script.pop(0) if script else 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeMooncake:
    fake = FakeMooncake()
    monkeypatch.setattr(_mooncake, "_create_mooncake", lambda: fake)
    return fake


async def test_rc_codes_become_transfer_errors(fake: FakeMooncake) -> None:
    fake.rc = {"register_memory": [-7], "unregister_memory": [-3], "transfer_check_status": [-1]}
    async with MooncakeEngine() as engine:
        assert engine.session_id == "127.0.0.1:15000"
        with pytest.raises(
            TransferError, match=r"register_memory of 0x1000 \(64 bytes\) failed \(rc=-7\)"
        ):
            engine.register(0x1000, 64)
        assert engine.registered_regions() == 0
        engine.register(0x1000, 64)
        with pytest.raises(TransferError, match=r"mooncake write to peer:1 failed \(rc=-1\)"):
            engine.write("peer:1", 0x1000, 0x9000, 64)
        with pytest.raises(TransferError, match=r"unregister_memory of 0x1000 failed \(rc=-3\)"):
            engine.deregister(0x1000)
        # A failed deregistration keeps the region, so it can be retried.
        assert engine.registered_regions() == 1
        engine.deregister(0x1000)
        assert engine.registered_regions() == 0
    assert fake.calls[0] == ("initialize", "127.0.0.1", "P2PHANDSHAKE", "tcp", "")


async def test_exit_deregisters_every_leftover_and_logs_failures(
    fake: FakeMooncake, caplog: pytest.LogCaptureFixture
) -> None:
    fake.rc = {"unregister_memory": [-3, 0]}
    async with MooncakeEngine("10.0.0.5:17001", "http://meta:8080/metadata") as engine:
        # Metadata-server mode: peers address the engine by the hostname it was given.
        assert engine.session_id == "10.0.0.5:17001"
        engine.register(0x1000, 64)
        engine.register(0x2000, 64)
    unregistered = [call for call in fake.calls if call[0] == "unregister_memory"]
    assert unregistered == [("unregister_memory", 0x1000), ("unregister_memory", 0x2000)]
    assert engine.registered_regions() == 0
    failures = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failures) == 1
    assert "0x1000" in failures[0].getMessage()


async def test_failed_initialize_raises_on_entering(fake: FakeMooncake) -> None:
    fake.rc = {"initialize": [-1]}
    engine = MooncakeEngine("127.0.0.1:17001")
    with pytest.raises(TransferError, match=r"initialize of 127.0.0.1:17001 .* failed \(rc=-1\)"):
        async with engine:
            pytest.fail("entered a failed engine")
    with pytest.raises(TransferError):
        _ = engine.session_id


async def test_a_cancelled_start_still_stops_what_it_started(fake: FakeMooncake) -> None:
    started, release = threading.Event(), threading.Event()
    fake.block_initialize = (started, release)
    engine = MooncakeEngine()
    entered: list[bool] = []

    async def enter() -> None:
        async with engine:
            entered.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(enter)
        # Polled rather than waited for in a second worker thread: the test should not
        # depend on the thread pool while one of its threads is deliberately blocked.
        with anyio.fail_after(30):
            while not started.is_set():
                await anyio.sleep(0.001)
        # Cancelled while the worker thread initializes; the thread still runs to its end.
        tg.cancel_scope.cancel()
        release.set()
    assert entered == []
    assert [call[0] for call in fake.calls] == ["initialize"]
    with pytest.raises(TransferError, match="closed"):
        _ = engine.session_id


async def test_a_missing_mooncake_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(ImportError, match=r"encdisagg\[mooncake-cpu\].*libibverbs1"):
        async with MooncakeEngine():
            pass
