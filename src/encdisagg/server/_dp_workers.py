"""Data parallel: supervising the worker processes (start, readiness, exit, stop).

Workers are spawned as ``python -m encdisagg.server._worker`` (a fresh interpreter: no
inherited event loop, threads or CUDA state, and no pickle on the way in; the Encoder config
travels as a JSON file). They are started before the service is reported up and stopped on
exit: a ``stop`` message, then SIGTERM, then SIGKILL, each step bounded.
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

from .._errors import ServiceUnavailableError
from ..nurseries import ServiceTaskGroup
from ._ipc import ControlMessage, IpcSocket
from ._settings import ServerSettings

__all__ = ["DpWorker", "WorkerSupervisor"]

_log = logging.getLogger("encdisagg.server.dp")

#: How often a stopping front polls for its workers' exits.
_EXIT_POLL_S: Final = 0.05
#: Most time each escalation step (SIGTERM, SIGKILL) waits once a stop message was ignored.
_KILL_STEP_S: Final = 5.0


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
    #: Calls sent and not answered yet.
    load: int = 0
    #: Set once the worker reported ready or exited, whichever came first.
    settled: anyio.Event = field(default_factory=anyio.Event)
    exited: anyio.Event = field(default_factory=anyio.Event)

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

    def require_alive(self, req_id: str | None) -> DpWorker:
        """This worker, if it is alive.

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
        return self


def _package_root() -> str:
    import encdisagg

    return str(Path(encdisagg.__file__).resolve().parent.parent)


class WorkerSupervisor:
    """Starts, watches and stops the worker processes of one data-parallel front.

    :param on_exit: called (synchronously) when a worker exits, with the worker and the
        message its unanswered calls fail with.
    """

    def __init__(
        self,
        workers: Sequence[DpWorker],
        *,
        command: Sequence[str],
        settings: ServerSettings,
        stop_timeout_s: float,
        on_exit: Callable[[DpWorker, str], None],
    ) -> None:
        self._workers = workers
        self._command = list(command)
        self._settings = settings
        self._stop_timeout_s = stop_timeout_s
        self._on_exit = on_exit
        #: Set once stopping began: exits from then on are expected.
        self.stopping = False

    async def spawn(
        self,
        worker: DpWorker,
        *,
        results_url: str,
        config_file: Path,
        backend_name: str,
        group: ServiceTaskGroup,
    ) -> None:
        """Start ``worker``'s process and its watcher (in ``group``). A checkpoint."""
        settings = self._settings
        command = [
            *self._command,
            "--rank",
            str(worker.rank),
            "--work",
            worker.work.url,
            "--control",
            worker.control.url,
            "--results",
            results_url,
            "--config-file",
            str(config_file),
            "--backend",
            backend_name,
            "--parent-pid",
            str(os.getpid()),
            "--health-timeout",
            str(settings.health_timeout_s),
            "--max-inflight",
            str(settings.worker_max_inflight),
            "--log-level",
            settings.worker_log_level,
        ]
        env = dict(os.environ)
        root = _package_root()
        env["PYTHONPATH"] = os.pathsep.join(
            [root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
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
                    raise ServiceUnavailableError(
                        f"{worker.describe()} exited with code {worker.exit_code} before it "
                        "was ready"
                    )
            return
        raise ServiceUnavailableError(
            f"data-parallel workers were not ready within worker_start_timeout_s={timeout}"
        )

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
            _log.info("%s exited with code %s", worker.describe(), code)
        else:
            message = f"{worker.describe()} died (exit code {code})"
            _log.error("%s", message)
        self._on_exit(worker, message)

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
