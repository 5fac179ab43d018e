"""Data parallel: which worker takes an encode, and where each ``req_id`` lives.

Synchronous decisions (DESIGN §2): an encode goes to the live worker with the fewest
unanswered calls (round-robin among ties), unless a worker already holds its ``req_id``;
every later call for that ``req_id`` follows it there. Routes expire, so the table stays
bounded; only :meth:`Router.wait_route` awaits. When a worker dies, its routes are marked
lost: a restarted process of that rank does not hold them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import anyio

from ..._errors import RequestTimeoutError, ServiceUnavailableError
from ...nurseries import KeyedRendezvous

__all__ = ["RoutedWorker", "Router"]

#: How many ``req_id -> worker`` routes are remembered at most.
ROUTE_LIMIT: Final = 100_000


class RoutedWorker(Protocol):
    """What routing needs to know of a worker."""

    @property
    def rank(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    @property
    def load(self) -> int:
        """Calls sent to it and not answered yet."""
        ...


@dataclass(frozen=True, slots=True)
class _Route:
    rank: int
    expires_at: float
    #: The worker that held it died: the request is gone.
    lost: bool = False


class Router:
    """The ``req_id -> worker rank`` table of one data-parallel front.

    :param workers: the workers, indexed by rank.
    :param ttl_s: how long a route lives after its last use.
    :param limit: most routes kept; the least recently used go first.
    """

    def __init__(
        self, workers: Sequence[RoutedWorker], *, ttl_s: float, limit: int = ROUTE_LIMIT
    ) -> None:
        self._workers = workers
        self._ttl_s = ttl_s
        self._limit = limit
        # Least recently used first.
        self._routes: OrderedDict[str, _Route] = OrderedDict()
        self._published: KeyedRendezvous[str, int] = KeyedRendezvous()
        self._round_robin = 0

    def _prune(self) -> None:
        now = anyio.current_time()
        while self._routes:
            req_id, route = next(iter(self._routes.items()))
            if route.expires_at > now and len(self._routes) <= self._limit:
                break
            del self._routes[req_id]
            self._published.remove(req_id)

    def _set(self, req_id: str, rank: int, *, lost: bool = False) -> None:
        self._routes[req_id] = _Route(rank, anyio.current_time() + self._ttl_s, lost)
        self._routes.move_to_end(req_id)
        if self._published.get(req_id) != rank:
            self._published.publish(req_id, rank)

    def route_of(self, req_id: str) -> int | None:
        """The rank holding ``req_id`` (its route refreshed), or ``None``. Not a checkpoint."""
        self._prune()
        route = self._routes.get(req_id)
        if route is None:
            return None
        self._set(req_id, route.rank, lost=route.lost)
        return route.rank

    def route_encode(self, req_id: str) -> int:
        """The rank for an encode of ``req_id``, now routed there. Not a checkpoint.

        The worker holding the id if it is alive (it answers 409 if the id is live), else
        the least loaded live one.

        :raises ServiceUnavailableError: no worker is alive.
        """
        rank = self.route_of(req_id)
        if rank is None or not self._workers[rank].alive:
            live = [w for w in self._workers if w.alive]
            if not live:
                raise ServiceUnavailableError("no data-parallel worker is alive", req_id=req_id)
            size = len(self._workers)
            start = self._round_robin
            self._round_robin = (start + 1) % size
            rank = min(live, key=lambda w: (w.load, (w.rank - start) % size)).rank
        self._set(req_id, rank)
        return rank

    async def wait_route(self, req_id: str, timeout_s: float) -> int:
        """The rank holding ``req_id``, waiting at most ``timeout_s`` for an encode to be
        routed. A checkpoint only when it waits; waiting creates no route.

        :raises RequestTimeoutError: no encode of ``req_id`` was routed in time.
        """
        rank = self.route_of(req_id)
        if rank is not None:
            return rank
        try:
            with anyio.fail_after(timeout_s):
                return await self._published.wait(req_id)
        except TimeoutError:
            raise RequestTimeoutError(
                f"req_id {req_id!r} did not appear within {timeout_s} s", req_id=req_id
            ) from None

    def orphan(self, rank: int) -> None:
        """Worker ``rank`` died: mark the requests routed to it lost. Not a checkpoint."""
        for req_id, route in list(self._routes.items()):
            if route.rank == rank and not route.lost:
                self._routes[req_id] = _Route(rank, route.expires_at, lost=True)

    def is_lost(self, req_id: str) -> bool:
        """Whether ``req_id`` was held by a worker that died since. Not a checkpoint."""
        route = self._routes.get(req_id)
        return route is not None and route.lost

    def peek(self, req_id: str) -> int | None:
        """The rank ``req_id`` is routed to, without refreshing the route. Not a checkpoint."""
        route = self._routes.get(req_id)
        return None if route is None else route.rank
