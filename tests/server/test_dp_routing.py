"""The data-parallel routing table on its own: no processes, no sockets."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import pytest

from encdisagg import RequestTimeoutError, ServiceUnavailableError
from encdisagg.server._dp._dispatch import Router

pytestmark = pytest.mark.anyio


@dataclass
class _Worker:
    rank: int
    alive: bool = True
    load: int = 0


def _router(
    size: int = 3, *, ttl_s: float = 60.0, limit: int = 100
) -> tuple[Router, list[_Worker]]:
    workers = [_Worker(rank) for rank in range(size)]
    return Router(workers, ttl_s=ttl_s, limit=limit), workers


async def test_encodes_go_to_the_least_loaded_round_robin_among_ties() -> None:
    router, workers = _router()
    assert [router.route_encode(f"r{i}") for i in range(3)] == [0, 1, 2]
    workers[0].load = 5
    workers[2].load = 5
    assert router.route_encode("busy") == 1


async def test_a_req_id_stays_on_its_live_worker_and_moves_when_it_died() -> None:
    router, workers = _router()
    rank = router.route_encode("r")
    workers[rank].load = 10
    assert router.route_encode("r") == rank
    assert router.route_of("r") == rank
    workers[rank].alive = False
    moved = router.route_encode("r")
    assert moved != rank
    assert router.peek("r") == moved


async def test_no_live_worker_is_503_and_unknown_ids_have_no_route() -> None:
    router, workers = _router(size=1)
    workers[0].alive = False
    with pytest.raises(ServiceUnavailableError, match="no data-parallel worker"):
        router.route_encode("r")
    assert router.route_of("never") is None
    assert router.peek("never") is None


async def test_wait_route_wakes_when_the_encode_is_routed() -> None:
    router, _ = _router()
    ranks: list[int] = []

    async def wait() -> None:
        ranks.append(await router.wait_route("r", 10.0))

    async with anyio.create_task_group() as group:
        group.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        rank = router.route_encode("r")
    assert ranks == [rank]


@pytest.mark.virtual_time
async def test_wait_route_times_out_and_creates_no_route() -> None:
    router, _ = _router()
    with pytest.raises(RequestTimeoutError, match="did not appear"):
        await router.wait_route("r", 5.0)
    assert router.peek("r") is None


@pytest.mark.virtual_time
async def test_routes_expire_and_the_table_is_bounded() -> None:
    router, _ = _router(ttl_s=10.0, limit=2)
    for req_id in ("a", "b", "c"):
        router.route_encode(req_id)
    assert router.route_of("a") is None  # the least recently used went first
    assert router.route_of("c") is not None
    await anyio.sleep(11.0)
    assert router.route_of("b") is None
    assert router.route_of("c") is None
