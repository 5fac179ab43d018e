"""Each staged request's own deadline, kept by one task that never waits on a request.

Every deadline is its staging time plus the same ``send_timeout_s``, so deadlines arrive in
the order they fall due and a FIFO holds them sorted. The keeper sleeps until the first one
and then calls ``expire`` synchronously: expiring a request only cancels its jobs and marks
it released; the request's last job frees it. A stale request therefore never waits behind
another, and no request pays for a task or a task group of its own for its deadline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import anyio

from ._table import RequestRecord

__all__ = ["DeadlineKeeper"]


class DeadlineKeeper:
    """Calls ``expire(record)`` once ``record.deadline`` passed, unless it retired first.

    :param expire: the synchronous action; it must not await.
    :param live: how many requests are live; retired records are dropped from the FIFO
        once they outnumber the live ones (amortised O(1) per request), so a retired
        request's memory is not held until its deadline would have passed.
    """

    def __init__(self, expire: Callable[[RequestRecord], None], live: Callable[[], int]) -> None:
        self._expire = expire
        self._live = live
        self._queue: deque[RequestRecord] = deque()
        self._added: anyio.Event | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, record: RequestRecord) -> None:
        """Watch ``record`` (its deadline is not earlier than any watched one). Not a
        checkpoint."""
        queue = self._queue
        queue.append(record)
        if len(queue) > 2 * self._live() + 64:
            self._queue = queue = deque(r for r in queue if not r.retired)
        if self._added is not None:
            self._added.set()

    async def run(self) -> None:
        """Expire requests as their deadlines pass, until cancelled."""
        while True:
            queue = self._queue
            while queue and queue[0].retired:
                queue.popleft()
            if not queue:
                self._added = anyio.Event()
                await self._added.wait()
                self._added = None
                continue
            head = queue[0]
            if anyio.current_time() < head.deadline:
                await anyio.sleep_until(head.deadline)
                continue
            queue.popleft()
            if not head.retired:
                self._expire(head)
