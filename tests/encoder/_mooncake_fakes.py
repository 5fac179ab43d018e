"""A stand-in for Mooncake's pybind engine, put under a real :class:`MooncakeEngine`, whose
writes the test can leave unfinished: to pin down what happens to memory a write may still
read after the caller stopped waiting.

It speaks the rc-code API the wrapper uses (``transfer_submit_write`` plus
``transfer_check_status``, and ``transfer_sync_write``) and copies nothing. Each write takes
the next outcome the test planned:

- ``"done"``: finished at once;
- ``"fail"``: finished, failed (Mooncake freed the batch);
- ``"timeout"``: Mooncake answers TIMED_OUT (its synchronous call gives up with -1) while the
  write runs on, until the test calls :meth:`ScriptedMooncake.finish`;
- ``"running"``: answered as in progress until :meth:`finish`.

It records as violations what a NIC would punish silently: a region deregistered while an
unfinished write reads it, and a write from memory an unfinished write still reads (memory
handed to another request). A destroyed engine (``shutdown``) ends every write.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from encdisagg.transfer._mooncake import _engine as _mooncake

DONE, FAILED, TIMED_OUT, RUNNING = 1, -1, -2, 0


@dataclass
class _Write:
    local: int
    nbytes: int
    outcome: str
    finished: bool = False


@dataclass
class ScriptedMooncake:
    """The fake; see the module. ``plan`` lists the outcomes of the next writes."""

    plan: list[str] = field(default_factory=list)
    regions: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    writes: dict[int, _Write] = field(default_factory=dict)
    unregister_failures: int = 0
    unregistered: list[int] = field(default_factory=list)
    _next_batch: int = 0x100
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- the test's side ------------------------------------------------------------------

    def unfinished(self) -> list[_Write]:
        with self._lock:
            return [write for write in self.writes.values() if not write.finished]

    def finish(self) -> None:
        """Every write running now ends (its slices stopped touching memory)."""
        with self._lock:
            for write in self.writes.values():
                if not write.finished:
                    write.finished = True
                    if write.outcome in ("timeout", "running"):
                        write.outcome = "done"

    # -- the pybind API ---------------------------------------------------------------------

    def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 15000

    def register_memory(self, ptr: int, nbytes: int) -> int:
        with self._lock:
            self.regions[ptr] = nbytes
        return 0

    def unregister_memory(self, ptr: int) -> int:
        with self._lock:
            if self.unregister_failures:
                self.unregister_failures -= 1
                return -1
            nbytes = self.regions.pop(ptr, 0)
            for write in self.writes.values():
                if not write.finished and _overlap(write.local, write.nbytes, ptr, nbytes):
                    self.violations.append(
                        f"deregistered {ptr:#x} while an unfinished write reads {write.local:#x}"
                    )
            self.unregistered.append(ptr)
        return 0

    def _start(self, local: int, nbytes: int) -> _Write:
        with self._lock:
            for write in self.writes.values():
                if not write.finished and _overlap(write.local, write.nbytes, local, nbytes):
                    self.violations.append(
                        f"a write from {local:#x} reads memory an unfinished write still reads"
                    )
            outcome = self.plan.pop(0) if self.plan else "done"
            write = _Write(local, nbytes, outcome, finished=outcome in ("done", "fail"))
            self._next_batch += 1
            self.writes[self._next_batch] = write
            return write

    def transfer_submit_write(self, target: str, local: int, remote: int, nbytes: int) -> int:
        self._start(local, nbytes)
        return self._next_batch

    def transfer_check_status(self, batch: int) -> int:
        with self._lock:
            write = self.writes[batch]
            if write.finished:
                return DONE if write.outcome == "done" else FAILED
            return TIMED_OUT if write.outcome == "timeout" else RUNNING

    def transfer_sync_write(self, target: str, local: int, remote: int, nbytes: int) -> int:
        # What Mooncake's synchronous call answers: -1 on failure and on its own timeout.
        write = self._start(local, nbytes)
        return 0 if write.outcome == "done" else -1

    def shutdown(self) -> None:
        """The engine is destroyed: no write touches memory any more."""
        self.finish()


def _overlap(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    return a < b + b_bytes and b < a + a_bytes


@pytest.fixture
def scripted_mooncake(monkeypatch: pytest.MonkeyPatch) -> ScriptedMooncake:
    """Every MooncakeEngine started in the test runs on this fake; Mooncake's own bound on a
    write is 0.2 s."""
    fake = ScriptedMooncake()
    monkeypatch.setattr(_mooncake, "_create_mooncake", lambda: fake)
    monkeypatch.setattr(_mooncake, "_mooncake_transfer_timeout_s", lambda: 0.2)
    return fake
