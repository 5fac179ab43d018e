"""A transfer engine for region-ownership tests: it audits, and a test scripts its calls.

Unlike :class:`~tests.encoder.fakes.RecordingEngine`, this engine never refuses a call for
breaking a rule: a real engine that keeps no region table accepts any pointer, and an
encoder that relies on the engine to catch its mistakes hides them. The rules are recorded
in :attr:`AuditingEngine.violations` instead, for the test to assert on.

Calls are numbered per operation, from 1, in the order they reach the engine. A test makes
the n-th call of an operation fail (:meth:`AuditingEngine.fail`) or wait until the test lets
it go (:meth:`AuditingEngine.hold`). No call copies memory: these tests are about who owns a
region and when, not about the bytes.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import anyio.from_thread
import anyio.lowlevel

from encdisagg import TransferError

Operation = Literal["register", "deregister", "write"]


@dataclass(eq=False)
class Hold:
    """One engine call that waits until the test lets it go.

    ``entered`` is set (on the test's event loop) once the call reached the engine.
    """

    entered: anyio.Event = field(default_factory=anyio.Event)
    _gate: threading.Event = field(default_factory=threading.Event)
    _token: anyio.lowlevel.EventLoopToken = field(default_factory=anyio.lowlevel.current_token)

    def let_go(self) -> None:
        """Let the call continue (also before it arrived). Not a checkpoint."""
        self._gate.set()

    def _wait(self) -> None:
        # Runs in the engine caller's worker thread.
        anyio.from_thread.run_sync(self.entered.set, token=self._token)
        self._gate.wait()


@contextmanager
def letting_go(*holds: Hold) -> Iterator[None]:
    """Let every hold go when the block ends, also when it fails: a failing test must not
    leave a worker thread parked, or the encoder waits for it for ever. Use it inside the
    task group (or ``async with Encoder``) that waits for the held call."""
    try:
        yield
    finally:
        for hold in holds:
            hold.let_go()


@dataclass(eq=False)
class AuditingEngine:
    """A TransferEngine (blocking calls, made from worker threads) that records violations.

    Violations recorded, never raised: registering a pointer that is registered already,
    deregistering a pointer that is not registered, deregistering a pointer while a write
    from it runs, writing from memory that no registration covers.
    """

    session_id: str = "auditing:1"
    #: Successful registrations and deregistrations, per pointer.
    registered: Counter[int] = field(default_factory=Counter)
    deregistered: Counter[int] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    #: Registrations in force: pointer → (how many times registered, size).
    live: dict[int, tuple[int, int]] = field(default_factory=dict)
    writes_done: int = 0
    _calls: Counter[str] = field(default_factory=Counter)
    _failures: dict[tuple[str, int], str] = field(default_factory=dict)
    _holds: dict[tuple[str, int], Hold] = field(default_factory=dict)
    _writing: Counter[int] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- scripting (from the test) ------------------------------------------------------------

    def fail(self, operation: Operation, call: int) -> None:
        """Make the ``call``-th call of ``operation`` raise TransferError (after any hold)."""
        self._failures[(operation, call)] = f"injected {operation} failure (call {call})"

    def hold(self, operation: Operation, call: int) -> Hold:
        """Make the ``call``-th call of ``operation`` wait until the returned hold lets go.

        Call from the test's event loop (the hold reports back to it)."""
        hold = Hold()
        self._holds[(operation, call)] = hold
        return hold

    def calls(self, operation: Operation) -> int:
        """How many calls of ``operation`` reached the engine so far."""
        with self._lock:
            return self._calls[operation]

    # -- the TransferEngine protocol ------------------------------------------------------------

    def _begin(self, operation: Operation) -> tuple[Hold | None, str | None]:
        with self._lock:
            self._calls[operation] += 1
            number = self._calls[operation]
        return self._holds.get((operation, number)), self._failures.get((operation, number))

    def register(self, ptr: int, nbytes: int) -> None:
        hold, failure = self._begin("register")
        if hold is not None:
            hold._wait()
        if failure is not None:
            raise TransferError(f"{failure} at {ptr:#x}")
        with self._lock:
            count, _ = self.live.get(ptr, (0, 0))
            if count:
                self.violations.append(f"registration of {ptr:#x}, registered already")
            self.live[ptr] = (count + 1, nbytes)
            self.registered[ptr] += 1

    def deregister(self, ptr: int) -> None:
        hold, failure = self._begin("deregister")
        during_write = f"deregistration of {ptr:#x} during a write from it"
        # Checked as the call starts and as it takes effect (once): both touch the mapping.
        with self._lock:
            under_write = self._writing[ptr] > 0
            if under_write:
                self.violations.append(during_write)
        if hold is not None:
            hold._wait()
        if failure is not None:
            raise TransferError(f"{failure} at {ptr:#x}")
        with self._lock:
            if not under_write and self._writing[ptr]:
                self.violations.append(during_write)
            count, nbytes = self.live.get(ptr, (0, 0))
            if not count:
                self.violations.append(f"deregistration of {ptr:#x}, which is not registered")
            elif count == 1:
                del self.live[ptr]
            else:
                self.live[ptr] = (count - 1, nbytes)
            self.deregistered[ptr] += 1

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        hold, failure = self._begin("write")
        with self._lock:
            region = next(
                (
                    base
                    for base, (_, size) in self.live.items()
                    if base <= local_ptr and local_ptr + nbytes <= base + size
                ),
                None,
            )
            if region is None:
                self.violations.append(f"write from unregistered memory {local_ptr:#x}")
            else:
                self._writing[region] += 1
        try:
            if hold is not None:
                hold._wait()
            if failure is not None:
                raise TransferError(failure)
        finally:
            with self._lock:
                if region is not None:
                    self._writing[region] -= 1
                self.writes_done += 1
