"""Data parallel: worker processes, each with its own Encoder, behind one front.

Ownership::

    DataParallelBackend          (async with; the app's lifespan holds it)
     ├─ temp dir + ZMQ context   ipc:// endpoints, removed on exit
     └─ service group
          ├─ result listener     decodes replies; drops malformed ones, keeps listening
          ├─ one watcher per worker process: awaits its exit, fails its calls with 503
          └─ a restart per dead worker: backoff, fresh channels, a new process

The parts, one file each: :mod:`._workers` starts, watches and stops the processes;
:mod:`._dispatch` decides (synchronously) which worker takes an encode and where a
``req_id`` lives; :mod:`._calls` sends calls and matches replies to them. This file
assembles them and serves the routes' calls. A worker's transfers go from the worker
straight to the receiver; only control messages pass through the front.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
from collections.abc import AsyncGenerator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Final, Protocol

import anyio
import anyio.lowlevel
import sniffio
import zmq

from ..._config import EncoderConfig
from ..._errors import EncdisaggError, NotFoundError, ServiceUnavailableError
from ..._numbers import whole
from ...encoder import EncodeResult
from ...nurseries import ServiceTaskGroup, collapse_single_error, run_thread_to_completion
from .._backend import HealthReport
from .._messages import (
    EncodeBody,
    MetadataBody,
    ReceiveUrlBody,
    ReleaseBody,
    SendBody,
    result_from_wire,
)
from .._metrics import MetricsSnapshot, ServiceSnapshot, WorkerStatus
from .._settings import ServerSettings
from ._calls import PendingCalls
from ._dispatch import Router
from ._ipc import MAX_REASON_CHARS, IpcSocket, MalformedMessage, ReplyMessage, WorkOp
from ._process_metrics import read_process_stats
from ._workers import DpWorker, WorkerSupervisor

__all__ = ["DataParallelBackend"]

_log = logging.getLogger("encdisagg.server.dp")

#: Longest temp folder for the ipc:// endpoints (Unix socket paths hold about 100 bytes).
_MAX_IPC_DIR: Final = 80
#: Bound on a ``stats`` call to one worker (for /metrics).
_STATS_TIMEOUT_S: Final = 5.0


class _Body(Protocol):
    """A route's body, as a call carries it to a worker."""

    @property
    def req_id(self) -> str: ...

    def to_wire(self) -> dict[str, Any]: ...


class DataParallelBackend(anyio.AsyncContextManagerMixin):
    """Serves the routes with ``workers`` worker processes (DESIGN rule 13).

    - An encode goes to the live worker with the fewest unanswered calls (round-robin among
      ties), or to the worker that already holds its ``req_id``; every later call for that
      ``req_id`` goes there too.
    - A call that times out or is cancelled after it was sent tells its worker, on the
      control channel, to cancel it; an encode or send also tells it to release the
      request.
    - A worker that exits fails its unanswered calls with 503; calls for the requests it
      held answer 503 (also once it runs again: they are lost); ``/health`` answers 503
      until it is back. It is started again with backoff, at most
      ``settings.worker_restart_limit`` times within ``worker_restart_window_s``.

    ``async with`` starts the workers and returns once each reported ready (its Encoder is
    open); leaving stops them (a ``stop`` message, then SIGTERM, then SIGKILL, each step
    bounded). A lone error raised in the block (or while starting) leaves it as itself, not
    wrapped in an exception group.

    :param config: each worker's Encoder configuration.
    :param workers: how many worker processes.
    :param settings: start/stop bounds, health probe bound, workers' event loop and log level.
    :param worker_command: the command that starts one worker, to which the front appends
        the worker's options (default: this interpreter running
        ``encdisagg.server._serve._worker``). A wrapper (``taskset``, ``numactl``...) may
        precede it.
    """

    def __init__(
        self,
        config: EncoderConfig,
        *,
        workers: int,
        settings: ServerSettings | None = None,
        worker_command: Sequence[str] | None = None,
    ) -> None:
        self._size = whole("workers", workers, least=1)
        self.config = config
        self.settings = settings or ServerSettings(dp=workers)
        self._worker_command = (
            list(worker_command)
            if worker_command is not None
            else [sys.executable, "-m", "encdisagg.server._serve._worker"]
        )
        self._workers: list[DpWorker] = []
        self._pending = PendingCalls()
        cfg = config
        self._router = Router(self._workers, ttl_s=2 * cfg.request_timeout_s + cfg.send_timeout_s)
        self._results: IpcSocket | None = None
        #: Where a restarted worker's channels are made (set while running).
        self._channel_source: tuple[zmq.Context[Any], Path] | None = None
        #: Messages from workers dropped as malformed.
        self.malformed_messages = 0
        stop = self.settings.worker_stop_timeout_s
        self._supervisor = WorkerSupervisor(
            self._workers,
            command=self._worker_command,
            settings=self.settings,
            stop_timeout_s=(
                stop if stop is not None else cfg.shutdown_grace_s + cfg.cleanup_timeout_s + 5.0
            ),
            on_exit=self._on_exit,
            channels=self._new_channels,
        )

    # -- lifecycle ------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[DataParallelBackend]:
        with collapse_single_error():
            async with self._run():
                yield self

    @asynccontextmanager
    async def _run(self) -> AsyncGenerator[None]:
        backend_name = self.settings.worker_backend or sniffio.current_async_library()
        directory = Path(tempfile.mkdtemp(prefix="encdisagg-dp-"))
        if len(str(directory)) > _MAX_IPC_DIR:
            # ipc:// paths are Unix socket paths: about 100 bytes at most.
            shutil.rmtree(directory, ignore_errors=True)
            directory = Path(tempfile.mkdtemp(prefix="encdisagg-dp-", dir="/tmp"))
        context: zmq.Context[Any] = zmq.Context()
        results_url = f"ipc://{directory}/results"
        self._channel_source = (context, directory)
        try:
            self._results = IpcSocket(context, zmq.PULL, results_url, bind=True)
            for rank in range(self._size):
                self._workers.append(DpWorker(rank, *self._channels(str(rank))))
            devices = self.settings.worker_devices or (self.config.device,) * self._size
            if len(devices) != self._size:
                raise ValueError(f"worker_devices lists {len(devices)} for {self._size} workers")
            # One config a worker: each may run on its own device.
            config_files = []
            for rank, device in enumerate(devices):
                config_file = directory / f"config-{rank}.json"
                mapping = self.config.replace(device=device).to_mapping()
                config_file.write_text(json.dumps(mapping), encoding="utf-8")
                config_files.append(config_file)
            async with ServiceTaskGroup("data-parallel front", logger=_log) as group:
                group.start_soon(self._listen, name="worker result listener")
                try:
                    await self._supervisor.start(
                        results_url=results_url,
                        config_files=config_files,
                        backend_name=backend_name,
                        group=group,
                    )
                    await self._supervisor.wait_ready()
                    yield
                finally:
                    await self._supervisor.stop()
        finally:
            for worker in self._workers:
                worker.work.close()
                worker.control.close()
            if self._results is not None:
                self._results.close()
            with anyio.CancelScope(shield=True):
                await run_thread_to_completion(context.destroy, 0)
            shutil.rmtree(directory, ignore_errors=True)

    def _on_exit(self, worker: DpWorker, message: str) -> None:
        self._pending.fail_rank(worker.rank, message)
        # What it held died with it, also once the rank runs again.
        self._router.orphan(worker.rank)

    def _new_channels(self, worker: DpWorker) -> tuple[IpcSocket, IpcSocket]:
        """Work and control channels for a new process of ``worker``'s rank: new
        endpoints, so nothing queued for the dead process reaches the new one."""
        return self._channels(f"{worker.rank}-{worker.restarts + 1}")

    def _channels(self, suffix: str) -> tuple[IpcSocket, IpcSocket]:
        """A worker's work and control channels, bound on endpoints named by ``suffix``."""
        assert self._channel_source is not None
        context, directory = self._channel_source
        work, control = (
            IpcSocket(context, zmq.PUSH, f"ipc://{directory}/{kind}-{suffix}", bind=True)
            for kind in ("work", "control")
        )
        return work, control

    # -- the result listener ------------------------------------------------------------------

    async def _listen(self) -> None:
        assert self._results is not None
        while True:
            try:
                data = await self._results.receive()
            except anyio.ClosedResourceError:
                return
            except zmq.ZMQError as exc:
                _log.error("receiving from the workers failed: %s", exc)
                await anyio.sleep(0.1)
                continue
            try:
                message = ReplyMessage.decode(data)
                self._on_reply(message)
            except MalformedMessage as exc:
                self.malformed_messages += 1
                _log.warning("dropped a malformed message from a worker: %s", exc)
            except Exception:
                self.malformed_messages += 1
                _log.exception("dropped a worker message that could not be handled")

    def _on_reply(self, message: ReplyMessage) -> None:
        if message.rank >= len(self._workers):
            raise MalformedMessage(f"reply from unknown rank {message.rank}")
        if message.kind == "ready":
            self._workers[message.rank].mark_ready(message.pid)
        elif message.kind == "failed":
            reason = (message.reason or "no reason given")[:MAX_REASON_CHARS]
            self._workers[message.rank].mark_failed(reason)
        else:
            self._pending.on_reply(message)

    # -- calls ---------------------------------------------------------------------------------

    async def _call(self, rank: int, op: WorkOp, body: _Body | None, limit_s: float) -> Any:
        """:meth:`PendingCalls.call` of ``body`` (``None``: a call on no request) on worker
        ``rank``, if it is alive and (for a call on a request) still the process that took
        it. A checkpoint; an encode, send or release cut short has the worker release it."""
        req_id = None if body is None else body.req_id
        worker = self._workers[rank]
        if op != "encode" and req_id is not None and self._router.is_lost(req_id):
            raise ServiceUnavailableError(
                f"{worker.describe()}, which held req_id {req_id!r}, died: the request is "
                "lost; encode it again",
                req_id=req_id,
            )
        worker.require_alive(req_id)
        args = {} if body is None else body.to_wire()
        return await self._pending.call(worker, op, args, req_id=req_id, limit_s=limit_s)

    @property
    def _call_bound_s(self) -> float:
        return self.config.request_timeout_s + 5.0

    async def encode(self, body: EncodeBody) -> EncodeResult:
        """Encode on the least loaded worker. A checkpoint; at most ``request_timeout_s``.
        Cancelled or timed out, the worker releases the request."""
        body.to_request()  # validate before choosing a worker
        rank = self._router.route_encode(body.req_id)
        value = await self._call(rank, "encode", body, self.config.request_timeout_s)
        return self._result(value, body.req_id)

    async def send(self, body: SendBody) -> None:
        """Deliver from the worker holding the request. A checkpoint.

        :raises NotFoundError: no worker holds ``req_id``.
        """
        rank = self._router.route_of(body.req_id)
        if rank is None:
            raise NotFoundError(f"req_id {body.req_id!r} is unknown", req_id=body.req_id)
        await self._call(rank, "send", body, self._call_bound_s + self.config.zmq_send_timeout_s)

    async def register(self, body: ReceiveUrlBody) -> None:
        """Push mode, on the worker holding (or about to hold) the request. A checkpoint."""
        rank = await self._router.wait_route(body.req_id, self.config.request_timeout_s)
        await self._call(rank, "register", body, self._call_bound_s)

    async def metadata(self, body: MetadataBody) -> EncodeResult:
        """Wait for the metadata on the worker holding the request. A checkpoint."""
        rank = await self._router.wait_route(body.req_id, self.config.request_timeout_s)
        value = await self._call(rank, "metadata", body, self._call_bound_s)
        return self._result(value, body.req_id)

    async def release(self, req_id: str) -> None:
        """Release on the worker holding the request; unknown ids are a no-op. A checkpoint."""
        rank = self._router.route_of(req_id)
        if rank is None or self._router.is_lost(req_id):
            await anyio.lowlevel.checkpoint()
            return
        await self._call(rank, "release", ReleaseBody(req_id), self._call_bound_s)

    def _result(self, value: object, req_id: str) -> EncodeResult:
        try:
            return result_from_wire(value)
        except EncdisaggError as exc:
            self.malformed_messages += 1
            raise ServiceUnavailableError(
                f"a worker answered with a malformed result: {exc.message}", req_id=req_id
            ) from None

    async def _broadcast(self, op: WorkOp, limit_s: float) -> dict[int, Any]:
        """Call ``op`` on every live worker at once; a reply or an error per rank."""
        outcomes: dict[int, Any] = {}

        async def one(rank: int) -> None:
            try:
                outcomes[rank] = await self._call(rank, op, None, limit_s)
            except EncdisaggError as exc:
                outcomes[rank] = exc

        async with anyio.create_task_group() as group:
            for worker in self._workers:
                if worker.alive:
                    group.start_soon(one, worker.rank)
        return outcomes

    async def health(self) -> HealthReport:
        """503 unless every worker is alive and answers its probe (or is busy)."""
        down = [w for w in self._workers if not w.alive]
        if down:
            return HealthReport(
                False,
                message="; ".join(
                    f"{w.describe()} is down (exit code {w.exit_code})" for w in down
                ),
            )
        outcomes = await self._broadcast("health", self.settings.health_timeout_s + 2.0)
        probed = False
        for rank in sorted(outcomes):
            outcome = outcomes[rank]
            if isinstance(outcome, EncdisaggError):
                return HealthReport(False, True, f"worker {rank}: {outcome.message}")
            try:
                report = HealthReport.from_wire(outcome)
            except ValueError:
                self.malformed_messages += 1
                return HealthReport(False, True, f"worker {rank}: malformed health report")
            if not report.ok:
                return HealthReport(False, True, f"worker {rank}: {report.message}")
            probed = probed or report.probed
        if len(outcomes) < len(self._workers):
            return HealthReport(False, probed, "a worker went down during the health check")
        return HealthReport(True, probed)

    async def snapshot(self) -> ServiceSnapshot:
        """Every live worker's metrics, summed, plus the workers' state and processes' CPU and
        memory. A checkpoint."""
        outcomes = await self._broadcast("stats", _STATS_TIMEOUT_S)
        snapshots = []
        for rank, outcome in outcomes.items():
            if isinstance(outcome, EncdisaggError):
                _log.warning("worker %s did not report metrics: %s", rank, outcome.message)
                continue
            try:
                snapshots.append(MetricsSnapshot.from_wire(outcome))
            except EncdisaggError as exc:
                self.malformed_messages += 1
                _log.warning("worker %s sent malformed metrics: %s", rank, exc.message)
        return ServiceSnapshot(
            MetricsSnapshot.merge(snapshots),
            tuple(replace(w, process=read_process_stats(w.pid)) for w in self.workers),
            self.malformed_messages,
        )

    # -- introspection (tests, metrics) -------------------------------------------------------

    @property
    def workers(self) -> tuple[WorkerStatus, ...]:
        """Each worker's state now. Not a checkpoint."""
        return tuple(
            WorkerStatus(w.rank, w.alive, w.load, w.pid, w.restarts) for w in self._workers
        )

    def pid_of(self, rank: int) -> int | None:
        """The process id of worker ``rank``."""
        return self._workers[rank].pid

    def rank_of(self, req_id: str) -> int | None:
        """The worker a ``req_id`` is routed to, if any. Not a checkpoint."""
        return self._router.peek(req_id)
