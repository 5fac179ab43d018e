"""Data parallel: supervising the worker processes (start, readiness, exit, stop).

Workers are spawned as ``python -m encdisagg.server._serve._worker`` (a fresh interpreter: no
inherited event loop, threads or CUDA state, and no pickle on the way in; the Encoder config
travels as a JSON file). They are started before the service is reported up and stopped on
exit: a ``stop`` message, then SIGTERM, then SIGKILL, each step bounded. A worker that dies
while the service runs is started again on fresh channels, with backoff, until its rank
died too often (:mod:`._restarts`); then the front gives up on it and says so.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import anyio
import anyio.abc

from ..._errors import ServiceUnavailableError
from ...nurseries import ServiceTaskGroup
from .._settings import ServerSettings
from ._ipc import ControlMessage, IpcSocket
from ._restarts import RestartPolicy

__all__ = ["DpWorker", "WorkerSupervisor"]

_log = logging.getLogger("encdisagg.server.dp")

#: How often a stopping front polls for its workers' exits.
_EXIT_POLL_S: Final = 0.05
#: Most time each escalation step (SIGTERM, SIGKILL) waits once a stop message was ignored.
_KILL_STEP_S: Final = 5.0
#: How long a worker's startup failure report may trail its exit.
_FAILURE_REPORT_GRACE_S: Final = 2.0
#: The folder holding this encdisagg, first on a worker's path: it imports the front's code.
_PACKAGE_ROOT: Final = str(Path(__file__).resolve().parents[3])


@dataclass(eq=False)
class DpWorker:
    """One worker process as the front sees it, with its work and control channels."""

    rank: int
    work: IpcSocket
    control: IpcSocket
    process: anyio.abc.Process | None = None
    pid: int | None = None
    #: Became ready and has not exited.
    alive: bool = False
    exit_code: int | None = None
    #: Why it could not start, as it reported (one line).
    startup_failure: str | None = None
    #: Set once it reported a startup failure.
    failure_reported: anyio.Event = field(default_factory=anyio.Event)
    #: Calls sent and not answered yet.
    load: int = 0
    #: Set once the worker reported ready or exited, whichever came first.
    settled: anyio.Event = field(default_factory=anyio.Event)
    exited: anyio.Event = field(default_factory=anyio.Event)
    #: How often this rank's process was started again.
    restarts: int = 0

    def describe(self) -> str:
        return f"data-parallel worker {self.rank}" + (f" (pid {self.pid})" if self.pid else "")

    def has_exited(self) -> bool:
        """Whether the process ended (seen by its watcher, or by polling it)."""
        process = self.process
        return self.exited.is_set() or (process is not None and process.returncode is not None)

    def mark_ready(self, pid: int | None) -> None:
        """The worker reported ready (ignored once it exited). Synchronous."""
        if self.exited.is_set():
            return
        self.alive = True
        self.pid = pid
        self.settled.set()
        _log.info("%s is ready", self.describe())

    def mark_failed(self, reason: str) -> None:
        """The worker reported that it could not open its Encoder. Synchronous."""
        if self.alive:
            return
        self.startup_failure = reason
        self.failure_reported.set()
        self.settled.set()

    def renew(self, work: IpcSocket, control: IpcSocket) -> None:
        """Start over on fresh channels, for a new process of this rank. Synchronous."""
        self.work, self.control = work, control
        self.process = None
        self.pid = None
        self.alive = False
        self.exit_code = None
        self.startup_failure = None
        self.failure_reported = anyio.Event()
        self.settled = anyio.Event()
        self.exited = anyio.Event()
        self.restarts += 1

    def require_alive(self, req_id: str | None) -> None:
        """Refuse a call to this worker unless it is alive.

        :raises ServiceUnavailableError: it died or is not ready.
        """
        if not self.alive:
            state = "died" if self.exit_code is not None else "is not ready"
            raise ServiceUnavailableError(
                f"{self.describe()}, which holds req_id {req_id!r}, {state}"
                if req_id
                else f"{self.describe()} {state}",
                req_id=req_id,
            )


class WorkerSupervisor:
    """Starts, watches and stops the worker processes of one data-parallel front.

    :param on_exit: called (synchronously) when a worker exits, with the worker and the
        message its unanswered calls fail with.
    :param channels: fresh work and control channels for a new process of a rank.
    """

    def __init__(
        self,
        workers: Sequence[DpWorker],
        *,
        command: Sequence[str],
        settings: ServerSettings,
        stop_timeout_s: float,
        on_exit: Callable[[DpWorker, str], None],
        channels: Callable[[DpWorker], tuple[IpcSocket, IpcSocket]],
    ) -> None:
        self._workers = workers
        self._command = list(command)
        self._settings = settings
        self._stop_timeout_s = stop_timeout_s
        self._on_exit = on_exit
        self._channels = channels
        self._policy = RestartPolicy(
            limit=settings.worker_restart_limit, window_s=settings.worker_restart_window_s
        )
        #: What starting a rank (again) needs: results URL, backend, task group; config files.
        self._spawn_args: tuple[str, str, ServiceTaskGroup] | None = None
        self._config_files: list[Path] = []
        #: Set once stopping began: exits from then on are expected.
        self.stopping = False
        #: Set once every worker reported ready: exits from then on are deaths.
        self._all_ready = False

    async def start(
        self,
        *,
        results_url: str,
        config_files: Sequence[Path],
        backend_name: str,
        group: ServiceTaskGroup,
    ) -> None:
        """Start every worker's process (``config_files`` by rank) and its watcher (in
        ``group``). A checkpoint."""
        self._spawn_args = (results_url, backend_name, group)
        self._config_files = list(config_files)
        for worker in self._workers:
            await self._spawn(worker)

    async def _spawn(self, worker: DpWorker) -> None:
        assert self._spawn_args is not None
        results_url, backend_name, group = self._spawn_args
        settings = self._settings
        options: dict[str, object] = {
            "--rank": worker.rank,
            "--work": worker.work.url,
            "--control": worker.control.url,
            "--results": results_url,
            "--config-file": self._config_files[worker.rank],
            "--backend": backend_name,
            "--parent-pid": os.getpid(),
            "--health-timeout": settings.health_timeout_s,
            "--max-inflight": settings.worker_max_inflight,
            "--log-level": settings.worker_log_level,
            "--log-format": settings.worker_log_format,
        }
        command = [*self._command, *(str(part) for option in options.items() for part in option)]
        if settings.freeze_heap:
            command.append("--freeze-heap")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [_PACKAGE_ROOT, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
        )
        # A session of their own: a terminal's Ctrl-C reaches the front alone, which then
        # stops the workers in order.
        process = await anyio.open_process(
            command,
            stdin=subprocess.DEVNULL,
            stdout=None,
            stderr=None,
            env=env,
            start_new_session=True,
        )
        worker.process = process
        worker.pid = process.pid
        group.start_soon(self._watch, worker, name=f"watch worker {worker.rank}")

    async def wait_ready(self) -> None:
        """Wait (at most ``worker_start_timeout_s``) until every worker reported ready.

        :raises ServiceUnavailableError: a worker exited first, or the bound ran out.
        """
        timeout = self._settings.worker_start_timeout_s
        with anyio.move_on_after(timeout):
            for worker in self._workers:
                await worker.settled.wait()
                if not worker.alive:
                    raise ServiceUnavailableError(await self._startup_failure(worker))
            self._all_ready = True
            return
        raise ServiceUnavailableError(
            f"data-parallel workers were not ready within worker_start_timeout_s={timeout}"
        )

    async def _startup_failure(self, worker: DpWorker) -> str:
        """Why ``worker`` did not start: its own report, else its exit code."""
        if worker.exited.is_set() and not worker.failure_reported.is_set():
            # Its report and its exit travel different ways; the report may still come.
            with anyio.move_on_after(_FAILURE_REPORT_GRACE_S):
                await worker.failure_reported.wait()
        if worker.startup_failure is not None:
            return f"{worker.describe()} could not start: {worker.startup_failure}"
        return f"{worker.describe()} exited with code {worker.exit_code} before it was ready"

    async def _watch(self, worker: DpWorker) -> None:
        assert worker.process is not None
        code = await worker.process.wait()
        with anyio.CancelScope(shield=True):
            # Exited already: this only closes the process's transport.
            await worker.process.aclose()
        self._exited(worker, code)

    def _exited(self, worker: DpWorker, code: int) -> None:
        worker.alive = False
        worker.exit_code = code
        worker.exited.set()
        worker.settled.set()
        # Nothing may wait for room on a socket whose peer is gone.
        worker.work.close()
        worker.control.close()
        if self.stopping:
            message = f"{worker.describe()} stopped: the service is shutting down"
            # A startup that failed is reported in one line by wait_ready's caller.
            level = logging.INFO if self._all_ready else logging.DEBUG
            _log.log(level, "%s exited with code %s", worker.describe(), code)
        elif not self._all_ready:
            # Starting: wait_ready reports why, in one line.
            message = f"{worker.describe()} exited with code {code} before it was ready"
            _log.debug("%s", message)
        else:
            message = f"{worker.describe()} died (exit code {code})"
            if worker.startup_failure is not None:
                message += f" as it started again: {worker.startup_failure}"
            _log.error("%s", message)
        self._on_exit(worker, message)
        if self._all_ready and not self.stopping:
            self._plan_restart(worker)

    def _plan_restart(self, worker: DpWorker) -> None:
        """Start a dead worker again after its backoff, or give up on it. Synchronous."""
        delay = self._policy.on_death(worker.rank, anyio.current_time())
        if delay is None or self._spawn_args is None:
            _log.error(
                "giving up on data-parallel worker %s: it died %s time(s) within %s s; the "
                "other workers go on serving",
                worker.rank,
                self._policy.restarts(worker.rank) + 1,
                self._settings.worker_restart_window_s,
            )
            return
        group = self._spawn_args[2]
        group.start_soon(self._restart, worker, delay, name=f"restart worker {worker.rank}")

    async def _restart(self, worker: DpWorker, delay_s: float) -> None:
        await anyio.sleep(delay_s)
        if self.stopping:
            return
        worker.renew(*self._channels(worker))
        _log.warning("starting %s again (restart %d)", worker.describe(), worker.restarts)
        try:
            # Shielded: a process started must be watched, whatever cancels this task.
            with anyio.CancelScope(shield=True):
                await self._spawn(worker)
        except OSError as exc:
            _log.error("could not start %s again: %s", worker.describe(), exc)
            self._exited(worker, -1)
            return
        if not self.stopping:
            with anyio.move_on_after(self._settings.worker_start_timeout_s):
                await worker.settled.wait()
        if self.stopping or (not worker.alive and not worker.has_exited()):
            # Not ready in time (or no longer wanted): its exit is a death like any other.
            assert worker.process is not None
            with suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        """Stop every worker: a stop message, then SIGTERM, then SIGKILL (each bounded).

        Shielded: completes even when cancelled (then the watchers are cancelled too, so
        exits are seen by polling the processes).
        """
        self.stopping = True
        with anyio.CancelScope(shield=True):
            running = [w for w in self._workers if w.process is not None]
            for worker in running:
                if not worker.has_exited():
                    worker.control.send_nowait(ControlMessage("stop").to_wire())
            step_s = min(_KILL_STEP_S, self._stop_timeout_s)
            for step, timeout in (
                (None, self._stop_timeout_s),
                (signal.SIGTERM, step_s),
                (signal.SIGKILL, step_s),
            ):
                left = [w for w in running if not w.has_exited()]
                if not left:
                    break
                for worker in left:
                    if step is not None:
                        _log.warning("%s did not stop; sending %s", worker.describe(), step.name)
                        assert worker.process is not None
                        with suppress(ProcessLookupError):
                            worker.process.send_signal(step)
                with anyio.move_on_after(timeout):
                    # No event tells of an exit once the watchers are gone: poll.
                    while True:
                        await anyio.sleep(_EXIT_POLL_S)
                        if all(worker.has_exited() for worker in left):
                            break
            for worker in running:
                if not worker.has_exited():
                    _log.error("%s could not be stopped", worker.describe())
                elif not worker.exited.is_set():
                    # Its watcher was cancelled: close the process's transport here.
                    assert worker.process is not None
                    with anyio.move_on_after(_KILL_STEP_S):
                        await worker.process.aclose()
