"""A data-parallel worker process: one Encoder, driven over ZMQ IPC by the front.

Started by the front as ``python -m encdisagg.server._serve._worker ...`` (see ``_dp._front``);
not meant to be run by hand. Ownership::

    worker main                    anyio.run
     └─ LocalBackend               opens the Encoder; closing it drains and releases
          └─ call group            one task per call; the work and control listeners;
                                   the signal and parent watchers

It reports ``ready`` once its Encoder is open, serves calls until told to stop (a ``stop``
message, SIGTERM/SIGINT, or its parent went away), then cancels the calls in flight and
closes the Encoder, which releases every request.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import msgspec
import zmq

from ... import _tracing
from ..._config import EncoderConfig
from ..._errors import EncdisaggError, InternalError
from .._backend import LocalBackend
from .._dp._ipc import (
    ControlMessage,
    IpcSocket,
    MalformedMessage,
    ReplyMessage,
    WorkMessage,
)
from .._logs import configure_logging
from .._messages import (
    EncodeBody,
    MetadataBody,
    ReceiveUrlBody,
    ReleaseBody,
    SendBody,
    result_to_wire,
)
from ._noise import quiet_third_party
from ._startup import describe_startup_failure

__all__ = ["main"]

_log = logging.getLogger("encdisagg.server.worker")

#: Cancellations of calls not seen yet (the control channel may overtake the work channel).
_REMEMBERED_CANCELS: Final = 10_000
#: Bound on handing one reply to the front.
_REPLY_TIMEOUT_S: Final = 10.0
#: How often the worker checks that its parent is still there.
_PARENT_POLL_S: Final = 1.0


@dataclass(eq=False)
class _Encoding:
    req_id: str
    calls: int = 0
    done: anyio.Event = field(default_factory=anyio.Event)


class _Worker:
    """Serves one worker's calls. State changes happen in synchronous code."""

    def __init__(
        self, rank: int, backend: LocalBackend, results: IpcSocket, max_inflight: int
    ) -> None:
        self.rank = rank
        self.backend = backend
        self.results = results
        self._slots = anyio.Semaphore(max_inflight)
        self._calls: dict[int, anyio.CancelScope] = {}
        self._cancelled: OrderedDict[int, None] = OrderedDict()
        # Encode calls in flight by req_id. A send for a request whose encode call arrived
        # but may not have reached the Encoder yet waits for it to return.
        self._encoding: dict[str, _Encoding] = {}
        self.stop = anyio.Event()
        self._group: anyio.abc.TaskGroup | None = None

    async def run(self, work: IpcSocket, control: IpcSocket, parent_pid: int) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            await group.start(self._watch_signals)
            with anyio.fail_after(_REPLY_TIMEOUT_S):
                await self.results.send(ReplyMessage("ready", self.rank, pid=os.getpid()).to_wire())
            group.start_soon(self._work_loop, work)
            group.start_soon(self._control_loop, control)
            group.start_soon(self._watch_parent, parent_pid)
            await self.stop.wait()
            _log.info("worker %s stopping", self.rank)
            group.cancel_scope.cancel()

    async def _watch_signals(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                _log.info("worker %s got signal %s", self.rank, signum)
                self.stop.set()

    async def _watch_parent(self, parent_pid: int) -> None:
        # No event tells a process its parent died; poll (cheap, and bounded by the poll).
        while True:
            await anyio.sleep(_PARENT_POLL_S)
            if os.getppid() != parent_pid:
                break
        _log.warning("worker %s: the front (pid %s) went away; stopping", self.rank, parent_pid)
        self.stop.set()

    # -- work ------------------------------------------------------------------------------

    async def _work_loop(self, work: IpcSocket) -> None:
        assert self._group is not None
        while True:
            # Take a slot before reading, so a busy worker leaves calls queued in ZMQ.
            await self._slots.acquire()
            try:
                data = await work.receive()
                message = WorkMessage.decode(data)
            except MalformedMessage as exc:
                self._slots.release()
                _log.warning("worker %s dropped a malformed call: %s", self.rank, exc)
                continue
            except BaseException:
                self._slots.release()
                raise
            if message.id in self._cancelled:
                del self._cancelled[message.id]
                self._slots.release()
                continue
            scope = anyio.CancelScope()
            self._calls[message.id] = scope
            encoding = self._mark_encoding(message)
            self._group.start_soon(self._run_call, message, scope, encoding)

    def _mark_encoding(self, message: WorkMessage) -> _Encoding | None:
        req_id = message.args.get("req_id")
        if message.op != "encode" or not isinstance(req_id, str):
            return None
        entry = self._encoding.get(req_id)
        if entry is None:
            entry = self._encoding[req_id] = _Encoding(req_id)
        entry.calls += 1
        return entry

    def _unmark_encoding(self, entry: _Encoding | None) -> None:
        if entry is None:
            return
        entry.calls -= 1
        if entry.calls == 0:
            if self._encoding.get(entry.req_id) is entry:
                del self._encoding[entry.req_id]
            entry.done.set()

    async def _run_call(
        self, message: WorkMessage, scope: anyio.CancelScope, encoding: _Encoding | None
    ) -> None:
        reply: ReplyMessage | None = None
        try:
            with scope:
                # A reply carries a value or an error, never both: each is unset until known.
                value: Any = msgspec.UNSET
                error: EncdisaggError | msgspec.UnsetType = msgspec.UNSET
                try:
                    with _call_span(message):
                        value = await self._execute(message)
                except EncdisaggError as exc:
                    error = exc
                except Exception as exc:
                    _log.exception("worker %s: %s call failed unexpectedly", self.rank, message.op)
                    req_id = message.args.get("req_id")
                    error = InternalError(
                        f"{message.op} failed unexpectedly: {exc!r}",
                        req_id=req_id if isinstance(req_id, str) else None,
                    )
                reply = ReplyMessage("result", self.rank, id=message.id, value=value, error=error)
        finally:
            self._calls.pop(message.id, None)
            self._unmark_encoding(encoding)
            self._slots.release()
        if reply is None or scope.cancel_called:
            return  # cancelled: the front gave up on this call
        with anyio.move_on_after(_REPLY_TIMEOUT_S):
            await self.results.send(reply.to_wire())
            return
        _log.error("worker %s could not hand the reply to call %s over", self.rank, message.id)

    async def _execute(self, message: WorkMessage) -> Any:
        backend = self.backend
        args = message.args
        match message.op:
            case "encode":
                return result_to_wire(await backend.encode(EncodeBody.from_json(args)))
            case "send":
                body = SendBody.from_json(args, internal=True)
                encoding = self._encoding.get(body.req_id)
                if encoding is not None:
                    await encoding.done.wait()
                await backend.send(body)
                return None
            case "register":
                await backend.register(ReceiveUrlBody.from_json(args))
                return None
            case "metadata":
                return result_to_wire(await backend.metadata(MetadataBody.from_json(args)))
            case "release":
                req_id = ReleaseBody.from_json(args).req_id
                if req_id in self._encoding:
                    # The encode may not have reached the Encoder yet: remember the release.
                    await backend.abandon(req_id)
                else:
                    await backend.release(req_id)
                return None
            case "health":
                return (await backend.health()).to_wire()
            case "stats":
                return (await backend.snapshot()).encoder.to_wire()
        raise InternalError(f"unknown op {message.op!r}")

    # -- control -----------------------------------------------------------------------------

    async def _control_loop(self, control: IpcSocket) -> None:
        assert self._group is not None
        while True:
            data = await control.receive()
            try:
                message = ControlMessage.decode(data)
            except MalformedMessage as exc:
                _log.warning("worker %s dropped a malformed control message: %s", self.rank, exc)
                continue
            if message.op == "stop":
                self.stop.set()
            elif message.op == "cancel":
                assert message.id is not None
                self._cancel(message.id)
            elif message.op == "release":
                assert message.req_id is not None
                self._group.start_soon(self._abandon, message.req_id)

    def _cancel(self, call_id: int) -> None:
        scope = self._calls.get(call_id)
        if scope is not None:
            scope.cancel()
            return
        # Not arrived yet (or finished already): skip it if it arrives.
        self._cancelled[call_id] = None
        while len(self._cancelled) > _REMEMBERED_CANCELS:
            self._cancelled.popitem(last=False)

    async def _abandon(self, req_id: str) -> None:
        try:
            await self.backend.abandon(req_id)
        except EncdisaggError as exc:
            _log.warning("worker %s: releasing req_id %r failed: %s", self.rank, req_id, exc)


async def _serve(args: argparse.Namespace, config: EncoderConfig) -> None:
    context: zmq.Context[Any] = zmq.Context()
    sockets: list[IpcSocket] = []
    try:
        sockets.extend(
            IpcSocket(context, zmq.PULL, url, bind=False) for url in (args.work, args.control)
        )
        sockets.append(IpcSocket(context, zmq.PUSH, args.results, bind=False))
        work, control, results = sockets
        opened = False
        try:
            async with LocalBackend(
                config, health_timeout_s=args.health_timeout, freeze_heap=args.freeze_heap
            ) as backend:
                opened = True
                worker = _Worker(args.rank, backend, results, args.max_inflight)
                await worker.run(work, control, args.parent_pid)
        except Exception as exc:
            if not opened:
                await _report_startup_failure(args.rank, results, exc)
            raise
    finally:
        for sock in sockets:
            sock.close()
        context.destroy(0)


async def _report_startup_failure(rank: int, results: IpcSocket, exc: Exception) -> None:
    """Tell the front, in one line, why this worker could not open its Encoder (bounded:
    the front may be gone). The front prints it; the traceback stays at debug level."""
    _log.debug("worker %s failed to start", rank, exc_info=exc)
    reason = describe_startup_failure(exc)
    with anyio.move_on_after(_REPLY_TIMEOUT_S):
        await results.send(ReplyMessage("failed", rank, reason=reason).to_wire())
        # Lingers so the report leaves before the process exits.
        results.close(linger_ms=int(_REPLY_TIMEOUT_S * 1000))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encdisagg-dp-worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("--config-file", required=True)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--health-timeout", type=float, default=20.0)
    parser.add_argument("--freeze-heap", action="store_true")
    parser.add_argument("--max-inflight", type=int, default=256)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one worker until it is told to stop; 0 on a clean stop."""
    args = _parser().parse_args(argv)
    if args.log_format == "json":
        configure_logging(args.log_level, "json", fields={"worker": args.rank})
    else:
        logging.basicConfig(
            level=args.log_level.upper(),
            format=f"%(asctime)s dp-worker-{args.rank} %(levelname)s %(name)s: %(message)s",
        )
    quiet_third_party(args.log_level)
    config = EncoderConfig.from_mapping(
        json.loads(Path(args.config_file).read_text(encoding="utf-8"))
    )
    try:
        anyio.run(_serve, args, config, backend=args.backend)
    except Exception:
        # Reported to the front (which prints one line) and logged at debug level.
        return 1
    return 0


def _call_span(message: WorkMessage) -> AbstractContextManager[object]:
    """A span for one call, current while it runs, continuing the front's trace; a no-op for
    an untraced call or when nobody traces in this worker."""
    if message.traceparent is None:
        return _tracing.span(None, "encdisagg.worker")
    trace = _tracing.from_traceparent(message.traceparent)
    return _tracing.span(trace, f"encdisagg.worker {message.op}", {"encdisagg.op": message.op})


if __name__ == "__main__":
    raise SystemExit(main())
