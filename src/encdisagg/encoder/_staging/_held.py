"""Staged embeddings a transfer may still touch after their records let go of them.

A record is freed once no job of its request runs, but a job that ended may have left a
transfer behind: a Mooncake write that outlived its bound, a ZMQ frame ZMQ did not let go
of. Its memory is then *held* (:class:`~encdisagg.transfer.Hold`): the free is deferred,
the memory stays allocated, registered and counted as staged, and an arena block is not
handed to the next request. Holds settle from any thread (an engine's completion thread,
pyzmq's); the news lands in an inbox here, and the region owner's task completes the free
on the event loop.
"""

from __future__ import annotations

import threading
from functools import partial

from ...nurseries import ThreadSafeEvent
from ...transfer import HeldLedger, Hold
from ._staged import Staged

__all__ = ["HeldStaging"]


class HeldStaging:
    """The held staged embeddings of one Encoder, and their holds' ledger.

    ``by_req_id`` (read on the event loop) names the request ids whose freed memory is still
    held, so that a late ``release`` of such an id can say so.
    """

    __slots__ = ("_deferred", "_lock", "_ready", "_wake", "by_req_id", "ledger")

    def __init__(self) -> None:
        self.ledger = HeldLedger("encoder")
        #: The latest lifecycle of each request id whose freed memory is still held.
        self.by_req_id: dict[str, Staged] = {}
        self._lock = threading.Lock()
        # Guarded by _lock: deferred frees, by staged embedding, and those whose holds all
        # settled, waiting for the owner task.
        self._deferred: dict[Staged, str] = {}
        self._ready: list[tuple[str, Staged]] = []
        self._wake: ThreadSafeEvent | None = None

    def __len__(self) -> int:
        return len(self._deferred)

    def take(self, staged: Staged, hold: Hold) -> None:
        """``hold`` is on ``staged``'s memory: count it, keep the memory through it. Not a
        checkpoint."""
        staged.take_hold(hold)
        self.ledger.add(hold)

    def defer(self, req_id: str, staged: Staged) -> None:
        """The record of ``req_id`` let go of ``staged`` while it is held: its free waits
        until every hold on it settled. Not a checkpoint."""
        with self._lock:
            self._deferred[staged] = req_id
        self.by_req_id[req_id] = staged
        for hold in list(staged.holds or ()):
            hold.on_settled(partial(self._settled, staged))

    def is_held(self, req_id: str) -> bool:
        """Whether the memory a freed lifecycle of ``req_id`` staged is still held."""
        staged = self.by_req_id.get(req_id)
        return staged is not None and staged.held

    def _settled(self, staged: Staged, hold: Hold) -> None:
        # Any thread. The last hold of a deferred embedding to settle makes it ready.
        if staged.held:
            return
        with self._lock:
            req_id = self._deferred.pop(staged, None)
            if req_id is None:
                return
            self._ready.append((req_id, staged))
            wake = self._wake
        if wake is not None:
            wake.set_from_thread()

    def arm(self) -> ThreadSafeEvent:
        """A fresh event the next settled hold sets; call it on the event loop, before
        :meth:`take_ready`, and wait on it after."""
        wake = ThreadSafeEvent()
        with self._lock:
            self._wake = wake
        return wake

    def take_ready(self) -> list[tuple[str, Staged]]:
        """The deferred embeddings whose holds all settled since the last call; each is
        forgotten here (its free is the caller's now). Not a checkpoint."""
        with self._lock:
            ready, self._ready = self._ready, []
        for req_id, staged in ready:
            if self.by_req_id.get(req_id) is staged:
                del self.by_req_id[req_id]
        return ready

    def still_held(self) -> list[tuple[str, Staged]]:
        """The deferred embeddings some hold still keeps."""
        with self._lock:
            return [(req_id, staged) for staged, req_id in self._deferred.items()]
