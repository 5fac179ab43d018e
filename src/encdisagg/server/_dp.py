"""Data parallel: worker processes, each with its own Encoder, behind one front.

Ownership::

    DataParallelBackend          (async with; the app's lifespan holds it)
     ├─ temp dir + ZMQ context   ipc:// endpoints, removed on exit
     └─ service group
          ├─ result listener     decodes replies; drops malformed ones, keeps listening
          └─ one watcher per worker process: awaits its exit, fails its calls with 503

Workers are spawned as ``python -m encdisagg.server._worker`` (a fresh interpreter: no
inherited event loop, threads or CUDA state, and no pickle on the way in; the Encoder config
travels as a JSON file). They are started before the service is reported up and stopped on
exit: a ``stop`` message, then SIGTERM, then SIGKILL, each step bounded.

Routing decisions (which worker takes an encode, where a ``req_id`` lives) are synchronous
methods; the awaiting happens around them. A worker's transfers go from the worker straight
to the receiver; only control messages pass through the front.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import sniffio
import zmq

from .._config import EncoderConfig
from .._errors import (
    EncdisaggError,
    NotFoundError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from ..encoder import EncodeResult
from ..nurseries import (
    KeyedRendezvous,
    ServiceTaskGroup,
    collapse_single_error,
    run_thread_to_completion,
)
from ._backend import HealthReport
from ._ipc import (
    ControlMessage,
    IpcSocket,
    MalformedMessage,
    ReplyMessage,
    WorkMessage,
    unpack,
)
from ._messages import (
    EncodeBody,
    MetadataBody,
    ReceiveUrlBody,
    SendBody,
    result_from_wire,
)
from ._metrics import MetricsSnapshot, ServiceSnapshot, WorkerStatus

if TYPE_CHECKING:
    from ._app import ServerSettings

__all__ = ["DataParallelBackend"]

_log = logging.getLogger("encdisagg.server.dp")

#: How many ``req_id -> worker`` routes are remembered at most.
_ROUTE_LIMIT: Final = 100_000
#: How often a stopping front polls for its workers' exits.
_EXIT_POLL_S: Final = 0.05
#: Longest temp folder for the ipc:// endpoints (Unix socket paths hold about 100 bytes).
_MAX_IPC_DIR: Final = 80
#: Bound on a ``stats`` call to one worker (for /metrics).
_STATS_TIMEOUT_S: Final = 5.0
#: Most time each escalation step (SIGTERM, SIGKILL) waits once a stop message was ignored.
_KILL_STEP_S: Final = 5.0


@dataclass(eq=False)
class _Worker:
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


@dataclass(eq=False)
class _Pending:
    id: int
    rank: int
    req_id: str | None
    done: anyio.Event = field(default_factory=anyio.Event)
    reply: ReplyMessage | None = None
    #: Set instead of ``reply`` when the worker died.
    error: EncdisaggError | None = None


@dataclass(frozen=True, slots=True)
class _Route:
    rank: int
    expires_at: float


def _exited(worker: _Worker) -> bool:
    """Whether the worker's process ended (seen by its watcher, or by polling it)."""
    process = worker.process
    return worker.exited.is_set() or (process is not None and process.returncode is not None)


def _package_root() -> str:
    import encdisagg

    return str(Path(encdisagg.__file__).resolve().parent.parent)


class DataParallelBackend(anyio.AsyncContextManagerMixin):
    """Serves the routes with ``workers`` worker processes (DESIGN rule 13).

    - An encode goes to the live worker with the fewest unanswered calls (round-robin among
      ties), or to the worker that already holds its ``req_id``; every later call for that
      ``req_id`` goes there too.
    - A call that times out or is cancelled after it was sent tells its worker, on the
      control channel, to cancel it; an encode or send also tells it to release the
      request.
    - A worker that exits fails its unanswered calls with 503; calls for the requests it
      held answer 503; ``/health`` answers 503 until the service restarts.

    ``async with`` starts the workers and returns once each reported ready (its Encoder is
    open); leaving stops them (see the module docstring). A lone error raised in the block
    (or while starting) leaves it as itself, not wrapped in an exception group.

    :param config: each worker's Encoder configuration.
    :param workers: how many worker processes.
    :param settings: start/stop bounds, health probe bound, workers' event loop and log level.
    :param worker_command: the command that starts one worker, to which the front appends
        the worker's options (default: this interpreter running
        ``encdisagg.server._worker``). A wrapper (``taskset``, ``numactl``...) may precede it.
    """

    def __init__(
        self,
        config: EncoderConfig,
        *,
        workers: int,
        settings: ServerSettings | None = None,
        worker_command: Sequence[str] | None = None,
    ) -> None:
        from ._app import ServerSettings

        if workers < 1:
            raise ValueError(f"workers must be at least 1; got {workers}")
        self.config = config
        self.settings = settings or ServerSettings(dp=workers)
        self._size = workers
        self._worker_command = (
            list(worker_command)
            if worker_command is not None
            else [sys.executable, "-m", "encdisagg.server._worker"]
        )
        self._workers: list[_Worker] = []
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._routes: OrderedDict[str, _Route] = OrderedDict()
        self._route_published: KeyedRendezvous[str, int] = KeyedRendezvous()
        self._round_robin = 0
        self._stopping = False
        self._results: IpcSocket | None = None
        #: Messages from workers dropped as malformed.
        self.malformed_messages = 0
        cfg = config
        self._route_ttl_s = 2 * cfg.request_timeout_s + cfg.send_timeout_s
        stop = self.settings.worker_stop_timeout_s
        self._stop_timeout_s = (
            stop if stop is not None else cfg.shutdown_grace_s + cfg.cleanup_timeout_s + 5.0
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
        try:
            self._results = IpcSocket(context, zmq.PULL, f"ipc://{directory}/results", bind=True)
            for rank in range(self._size):
                self._workers.append(
                    _Worker(
                        rank,
                        IpcSocket(context, zmq.PUSH, f"ipc://{directory}/work-{rank}", bind=True),
                        IpcSocket(
                            context, zmq.PUSH, f"ipc://{directory}/control-{rank}", bind=True
                        ),
                    )
                )
            config_file = directory / "config.json"
            config_file.write_text(json.dumps(self.config.to_mapping()), encoding="utf-8")
            async with ServiceTaskGroup("data-parallel front", logger=_log) as group:
                group.start_soon(self._listen, name="worker result listener")
                try:
                    for worker in self._workers:
                        await self._spawn(worker, directory, config_file, backend_name, group)
                    await self._wait_ready()
                    yield
                finally:
                    await self._stop_workers()
        finally:
            for worker in self._workers:
                worker.work.close()
                worker.control.close()
            if self._results is not None:
                self._results.close()
            with anyio.CancelScope(shield=True):
                await run_thread_to_completion(context.destroy, 0)
            shutil.rmtree(directory, ignore_errors=True)

    async def _spawn(
        self,
        worker: _Worker,
        directory: Path,
        config_file: Path,
        backend_name: str,
        group: ServiceTaskGroup,
    ) -> None:
        settings = self.settings
        command = [
            *self._worker_command,
            "--rank",
            str(worker.rank),
            "--work",
            worker.work.url,
            "--control",
            worker.control.url,
            "--results",
            f"ipc://{directory}/results",
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

    async def _wait_ready(self) -> None:
        timeout = self.settings.worker_start_timeout_s
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

    async def _watch(self, worker: _Worker) -> None:
        assert worker.process is not None
        code = await worker.process.wait()
        with anyio.CancelScope(shield=True):
            # Exited already: this only closes the process's transport.
            await worker.process.aclose()
        self._on_exit(worker, code)

    def _on_exit(self, worker: _Worker, code: int) -> None:
        worker.alive = False
        worker.exit_code = code
        worker.exited.set()
        worker.settled.set()
        # Nothing may wait for room on a socket whose peer is gone.
        worker.work.close()
        worker.control.close()
        if self._stopping:
            message = f"{worker.describe()} stopped: the service is shutting down"
            _log.info("%s exited with code %s", worker.describe(), code)
        else:
            message = f"{worker.describe()} died (exit code {code})"
            _log.error("%s", message)
        for pending in list(self._pending.values()):
            if pending.rank == worker.rank and not pending.done.is_set():
                pending.error = ServiceUnavailableError(message, req_id=pending.req_id)
                pending.done.set()

    async def _stop_workers(self) -> None:
        """Stop every worker: a stop message, then SIGTERM, then SIGKILL (each bounded).
        Shielded: completes even when cancelled (then the watchers are cancelled too, so
        exits are seen by polling the processes)."""
        self._stopping = True
        with anyio.CancelScope(shield=True):
            running = [w for w in self._workers if w.process is not None]
            for worker in running:
                if not _exited(worker):
                    worker.control.send_nowait(ControlMessage("stop").to_wire())
            step_s = min(_KILL_STEP_S, self._stop_timeout_s)
            for step, timeout in (
                (None, self._stop_timeout_s),
                (signal.SIGTERM, step_s),
                (signal.SIGKILL, step_s),
            ):
                left = [w for w in running if not _exited(w)]
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
                        if all(_exited(worker) for worker in left):
                            break
            for worker in running:
                if not _exited(worker):
                    _log.error("%s could not be stopped", worker.describe())
                elif not worker.exited.is_set():
                    # Its watcher was cancelled: close the process's transport here.
                    assert worker.process is not None
                    with anyio.move_on_after(_KILL_STEP_S):
                        await worker.process.aclose()

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
                message = ReplyMessage.from_wire(unpack(data))
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
        worker = self._workers[message.rank]
        if message.kind == "ready":
            if not worker.exited.is_set():
                worker.alive = True
                worker.pid = message.pid
                worker.settled.set()
                _log.info("%s is ready", worker.describe())
            return
        assert message.id is not None
        pending = self._pending.get(message.id)
        if pending is None or pending.rank != message.rank:
            _log.debug("dropped the late reply to call %s from rank %s", message.id, message.rank)
            return
        pending.reply = message
        pending.done.set()

    # -- routing (synchronous decisions) -------------------------------------------------------

    def _prune_routes(self) -> None:
        now = anyio.current_time()
        while self._routes:
            req_id, route = next(iter(self._routes.items()))
            if route.expires_at > now and len(self._routes) <= _ROUTE_LIMIT:
                break
            del self._routes[req_id]
            self._route_published.remove(req_id)

    def _set_route(self, req_id: str, rank: int) -> None:
        self._routes[req_id] = _Route(rank, anyio.current_time() + self._route_ttl_s)
        self._routes.move_to_end(req_id)
        if self._route_published.get(req_id) != rank:
            self._route_published.publish(req_id, rank)

    def _route_of(self, req_id: str) -> int | None:
        self._prune_routes()
        route = self._routes.get(req_id)
        if route is None:
            return None
        self._set_route(req_id, route.rank)
        return route.rank

    def _route_encode(self, req_id: str) -> int:
        """The worker for an encode of ``req_id``: the one holding the id if it is alive
        (it answers 409 if the id is live), else the least loaded live one."""
        rank = self._route_of(req_id)
        if rank is None or not self._workers[rank].alive:
            live = [w for w in self._workers if w.alive]
            if not live:
                raise ServiceUnavailableError("no data-parallel worker is alive", req_id=req_id)
            size = len(self._workers)
            start = self._round_robin
            self._round_robin = (start + 1) % size
            rank = min(live, key=lambda w: (w.load, (w.rank - start) % size)).rank
        self._set_route(req_id, rank)
        return rank

    def _live_worker(self, rank: int, req_id: str | None) -> _Worker:
        worker = self._workers[rank]
        if not worker.alive:
            state = "died" if worker.exit_code is not None else "is not ready"
            raise ServiceUnavailableError(
                f"{worker.describe()}, which holds req_id {req_id!r}, {state}"
                if req_id
                else f"{worker.describe()} {state}",
                req_id=req_id,
            )
        return worker

    def _abort(self, worker: _Worker, pending: _Pending, *, release: bool) -> None:
        """Tell a worker to drop a call its caller left (and release its request)."""
        ok = worker.control.send_nowait(ControlMessage("cancel", id=pending.id).to_wire())
        if release and pending.req_id is not None:
            ok = (
                worker.control.send_nowait(
                    ControlMessage("release", req_id=pending.req_id).to_wire()
                )
                and ok
            )
        if not ok and worker.alive:
            _log.warning(
                "could not tell %s to drop call %s (req_id %r)",
                worker.describe(),
                pending.id,
                pending.req_id,
            )

    # -- calls ---------------------------------------------------------------------------------

    async def _call(
        self,
        rank: int,
        op: str,
        args: dict[str, Any],
        *,
        req_id: str | None,
        limit_s: float,
        release_on_abort: bool = False,
    ) -> Any:
        """Send one call to worker ``rank`` and wait (at most ``limit_s``) for its reply.

        A checkpoint. If it times out or is cancelled after the call reached ZMQ, the worker
        is told to cancel it (and, with ``release_on_abort``, to release ``req_id``).
        """
        worker = self._live_worker(rank, req_id)
        pending = _Pending(next(self._ids), rank, req_id)
        self._pending[pending.id] = pending
        worker.load += 1
        sent = False
        try:
            with anyio.fail_after(limit_s):
                await worker.work.send(WorkMessage(pending.id, op, args).to_wire())
                sent = True
                await pending.done.wait()
        except TimeoutError:
            if sent:
                self._abort(worker, pending, release=release_on_abort)
            raise RequestTimeoutError(
                f"{worker.describe()} did not answer {op} within {limit_s} s", req_id=req_id
            ) from None
        except anyio.ClosedResourceError:
            raise ServiceUnavailableError(
                f"{worker.describe()} died before it took {op}", req_id=req_id
            ) from None
        except BaseException:
            # Cancelled (the client left): the worker must not keep what it started.
            if sent:
                self._abort(worker, pending, release=release_on_abort)
            raise
        finally:
            del self._pending[pending.id]
            worker.load -= 1
        if pending.error is not None:
            raise pending.error
        reply = pending.reply
        assert reply is not None
        if reply.error is not None:
            raise reply.error
        return reply.value

    async def _wait_route(self, req_id: str) -> int:
        rank = self._route_of(req_id)
        if rank is not None:
            return rank
        timeout = self.config.request_timeout_s
        try:
            with anyio.fail_after(timeout):
                return await self._route_published.wait(req_id)
        except TimeoutError:
            raise RequestTimeoutError(
                f"req_id {req_id!r} did not appear within {timeout} s", req_id=req_id
            ) from None

    @property
    def _call_bound_s(self) -> float:
        return self.config.request_timeout_s + 5.0

    async def encode(self, body: EncodeBody) -> EncodeResult:
        """Encode on the least loaded worker. A checkpoint; at most ``request_timeout_s``.
        Cancelled or timed out, the worker releases the request."""
        body.to_request()  # validate before choosing a worker
        rank = self._route_encode(body.req_id)
        value = await self._call(
            rank,
            "encode",
            body.to_wire(),
            req_id=body.req_id,
            limit_s=self.config.request_timeout_s,
            release_on_abort=True,
        )
        return self._result(value, body.req_id)

    async def send(self, body: SendBody) -> None:
        """Deliver from the worker holding the request. A checkpoint.

        :raises NotFoundError: no worker holds ``req_id``.
        """
        rank = self._route_of(body.req_id)
        if rank is None:
            raise NotFoundError(f"req_id {body.req_id!r} is unknown", req_id=body.req_id)
        await self._call(
            rank,
            "send",
            body.to_wire(),
            req_id=body.req_id,
            limit_s=self._call_bound_s + self.config.zmq_send_timeout_s,
            release_on_abort=True,
        )

    async def register(self, body: ReceiveUrlBody) -> None:
        """Push mode, on the worker holding (or about to hold) the request. A checkpoint."""
        rank = await self._wait_route(body.req_id)
        await self._call(
            rank, "register", body.to_wire(), req_id=body.req_id, limit_s=self._call_bound_s
        )

    async def metadata(self, body: MetadataBody) -> EncodeResult:
        """Wait for the metadata on the worker holding the request. A checkpoint."""
        rank = await self._wait_route(body.req_id)
        value = await self._call(
            rank, "metadata", body.to_wire(), req_id=body.req_id, limit_s=self._call_bound_s
        )
        return self._result(value, body.req_id)

    async def release(self, req_id: str) -> None:
        """Release on the worker holding the request; unknown ids are a no-op. A checkpoint."""
        rank = self._route_of(req_id)
        if rank is None:
            return
        await self._call(
            rank,
            "release",
            {"req_id": req_id},
            req_id=req_id,
            limit_s=self._call_bound_s,
            release_on_abort=True,
        )

    def _result(self, value: object, req_id: str) -> EncodeResult:
        try:
            return result_from_wire(value)
        except EncdisaggError as exc:
            self.malformed_messages += 1
            raise ServiceUnavailableError(
                f"a worker answered with a malformed result: {exc.message}", req_id=req_id
            ) from None

    async def _broadcast(self, op: str, limit_s: float) -> dict[int, Any]:
        """Call ``op`` on every live worker at once; a reply or an error per rank."""
        outcomes: dict[int, Any] = {}

        async def one(rank: int) -> None:
            try:
                outcomes[rank] = await self._call(rank, op, {}, req_id=None, limit_s=limit_s)
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
        """Every live worker's metrics, summed, plus the workers' state. A checkpoint."""
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
            tuple(WorkerStatus(w.rank, w.alive, w.load) for w in self._workers),
            self.malformed_messages,
        )

    # -- introspection (tests, metrics) -------------------------------------------------------

    @property
    def workers(self) -> tuple[WorkerStatus, ...]:
        """Each worker's state now. Not a checkpoint."""
        return tuple(WorkerStatus(w.rank, w.alive, w.load) for w in self._workers)

    def pid_of(self, rank: int) -> int | None:
        """The process id of worker ``rank``."""
        return self._workers[rank].pid

    def rank_of(self, req_id: str) -> int | None:
        """The worker a ``req_id`` is routed to, if any. Not a checkpoint."""
        route = self._routes.get(req_id)
        return None if route is None else route.rank
