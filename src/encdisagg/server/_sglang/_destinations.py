"""Where SGLang's scheduler ranks want a part pushed (``zmq_to_scheduler``).

Each rank registers its PULL endpoint with ``/scheduler_receive_url`` (``receive_count`` is
the number of ranks); registrations may come before or after the part's ``/encode``. The
``/encode`` call waits for all of them, then pushes to each. Decisions here never await;
the one wait (:meth:`PushDestinations.wait_complete`) sits around them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final

import anyio
import anyio.lowlevel

from ..._errors import BadRequestError, RequestTimeoutError

__all__ = ["PushDestinations", "Registration"]

#: Most req_ids remembered at once; the oldest unused entries go first beyond it.
_MAX_ENTRIES: Final = 65536


@dataclass(eq=False)
class Registration:
    """One part's registered destinations.

    :ivar failure: set once the part failed: ``(message, status)``, pushed as an error part
        to every destination, also those registering later.
    :ivar done: the part was pushed (or failed); a new registration is then refused,
        unless it is to learn of the failure.
    """

    created: float
    count: int | None = None
    urls: list[str] = field(default_factory=list)
    changed: anyio.Event = field(default_factory=anyio.Event)
    waiting: bool = False
    done: bool = False
    failure: tuple[str, int] | None = None

    @property
    def complete(self) -> bool:
        return self.count is not None and len(self.urls) >= self.count


class PushDestinations:
    """The registrations of every part in flight, keyed by ``req_id``.

    :param ttl_s: how long an entry no ``/encode`` waits on is kept (a registration whose
        encode never came, or a finished part's record).
    """

    def __init__(self, *, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._entries: OrderedDict[str, Registration] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, req_id: str) -> Registration:
        """The entry of ``req_id``, created if new. Not a checkpoint."""
        self._prune()
        entry = self._entries.get(req_id)
        if entry is None:
            entry = self._entries[req_id] = Registration(anyio.current_time())
        return entry

    def register(self, req_id: str, receive_count: int, urls: tuple[str, ...]) -> list[str]:
        """Record a rank's registration; the URLs new to the entry. Not a checkpoint.

        :raises BadRequestError: a count other than the first registration's, or (after
            the part was pushed) "not active", as SGLang's encoder answers.
        """
        entry = self.get(req_id)
        if entry.done and entry.failure is None:
            raise BadRequestError("Encoder request is not active", req_id=req_id)
        if entry.count is not None and entry.count != receive_count:
            raise BadRequestError(
                f"Inconsistent receive_count: {receive_count} after {entry.count}", req_id=req_id
            )
        entry.count = receive_count
        new = [url for url in urls if url not in entry.urls]
        entry.urls.extend(new)
        if new:
            entry.changed.set()
            entry.changed = anyio.Event()
        return new

    async def wait_complete(self, req_id: str, timeout_s: float) -> list[str]:
        """Wait until ``receive_count`` destinations registered; their URLs.

        A checkpoint. While it waits, the entry is never pruned.

        :raises RequestTimeoutError: not all registered within ``timeout_s``.
        """
        entry = self.get(req_id)
        entry.waiting = True
        try:
            with anyio.move_on_after(timeout_s):
                while not entry.complete:
                    await entry.changed.wait()
            await anyio.lowlevel.checkpoint()
        finally:
            # Cancelled or done: the entry may be pruned again once its time is up.
            entry.waiting = False
        if not entry.complete:
            have = len(entry.urls)
            want = "?" if entry.count is None else entry.count
            raise RequestTimeoutError(
                f"req_id {req_id!r}: {have} of {want} scheduler destinations registered "
                f"within {timeout_s} s",
                req_id=req_id,
            )
        return list(entry.urls)

    def finish(self, req_id: str, failure: tuple[str, int] | None = None) -> list[str]:
        """Mark the part pushed (or failed); the URLs registered so far. Not a checkpoint."""
        entry = self.get(req_id)
        entry.done = True
        entry.failure = failure
        entry.created = anyio.current_time()  # kept for late registrations from now on
        self._entries.move_to_end(req_id)
        return list(entry.urls)

    def _prune(self) -> None:
        now = anyio.current_time()
        while self._entries:
            req_id, entry = next(iter(self._entries.items()))
            expired = now - entry.created > self._ttl_s
            if entry.waiting or not (expired or len(self._entries) > _MAX_ENTRIES):
                break
            del self._entries[req_id]
