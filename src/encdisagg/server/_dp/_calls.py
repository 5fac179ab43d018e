"""Data parallel: calls sent to workers, matched to their replies by id.

A call is one work message to one worker; the front waits for the reply with that call's id
(or for the worker's death). A caller that leaves — timed out or cancelled — after its call
reached ZMQ tells the worker, on the control channel, to drop it, so no worker keeps work
nobody waits for. Late replies to such calls are dropped.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Final

import anyio

from ... import _tracing
from ..._errors import EncdisaggError, RequestTimeoutError, ServiceUnavailableError
from ._ipc import ControlMessage, ReplyMessage, WorkMessage, WorkOp
from ._workers import DpWorker

__all__ = ["PendingCalls"]

_log = logging.getLogger("encdisagg.server.dp")

#: The calls whose worker, once the caller left (timed out or cancelled), releases the request.
_RELEASE_ON_ABORT: Final = frozenset({"encode", "send", "release"})


@dataclass(eq=False)
class _Pending:
    id: int
    rank: int
    req_id: str | None
    done: anyio.Event = field(default_factory=anyio.Event)
    reply: ReplyMessage | None = None
    #: Set instead of ``reply`` when the worker died.
    error: EncdisaggError | None = None


class PendingCalls:
    """The unanswered calls of one data-parallel front."""

    def __init__(self) -> None:
        self._calls: dict[int, _Pending] = {}
        self._ids = itertools.count(1)

    def on_reply(self, message: ReplyMessage) -> None:
        """Hand a worker's reply to the call waiting for it. Synchronous; a reply nobody
        waits for (the caller left, or the rank is not the call's) is dropped."""
        assert message.id is not None
        pending = self._calls.get(message.id)
        if pending is None or pending.rank != message.rank:
            _log.debug("dropped the late reply to call %s from rank %s", message.id, message.rank)
            return
        pending.reply = message
        pending.done.set()

    def fail_rank(self, rank: int, message: str) -> None:
        """Fail every unanswered call to worker ``rank`` with 503 (it exited). Synchronous."""
        for pending in list(self._calls.values()):
            if pending.rank == rank and not pending.done.is_set():
                pending.error = ServiceUnavailableError(message, req_id=pending.req_id)
                pending.done.set()

    async def call(
        self,
        worker: DpWorker,
        op: WorkOp,
        args: dict[str, Any],
        *,
        req_id: str | None,
        limit_s: float,
    ) -> Any:
        """Send one call to ``worker`` and wait (at most ``limit_s``) for its reply value.

        A checkpoint. If it times out or is cancelled after the call reached ZMQ, the worker
        is told to cancel it (and, for an encode, send or release, to release ``req_id``).

        :raises RequestTimeoutError: no reply within ``limit_s``.
        :raises ServiceUnavailableError: the worker died before it took or answered the call.
        :raises EncdisaggError: the error the worker answered with.
        """
        pending = _Pending(next(self._ids), worker.rank, req_id)
        self._calls[pending.id] = pending
        worker.load += 1
        sent = False
        try:
            with anyio.fail_after(limit_s):
                # The worker's spans continue the caller's trace (None: nobody traces).
                message = WorkMessage(pending.id, op, args, _tracing.current_traceparent())
                await worker.work.send(message.to_wire())
                sent = True
                await pending.done.wait()
        except TimeoutError:
            if sent:
                _abort(worker, pending, op)
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
                _abort(worker, pending, op)
            raise
        finally:
            del self._calls[pending.id]
            worker.load -= 1
        if pending.error is not None:
            raise pending.error
        reply = pending.reply
        assert reply is not None
        if isinstance(reply.error, EncdisaggError):
            raise reply.error
        return reply.value


def _abort(worker: DpWorker, pending: _Pending, op: WorkOp) -> None:
    """Tell a worker to drop a call its caller left (and release its request)."""
    ok = worker.control.send_nowait(ControlMessage("cancel", id=pending.id).to_wire())
    if op in _RELEASE_ON_ABORT and pending.req_id is not None:
        ok = (
            worker.control.send_nowait(ControlMessage("release", req_id=pending.req_id).to_wire())
            and ok
        )
    if not ok and worker.alive:
        _log.warning(
            "could not tell %s to drop call %s (req_id %r)",
            worker.describe(),
            pending.id,
            pending.req_id,
        )
