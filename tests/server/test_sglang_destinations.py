"""PushDestinations: the scheduler ranks' registrations of one part, decided without I/O."""

from __future__ import annotations

import anyio
import pytest

from encdisagg import BadRequestError, RequestTimeoutError
from encdisagg.server._sglang._destinations import PushDestinations

pytestmark = pytest.mark.anyio


async def test_registrations_before_and_during_the_wait_complete_it() -> None:
    destinations = PushDestinations(ttl_s=60)
    assert destinations.register("r", 2, ("tcp://a:1",)) == ["tcp://a:1"]
    # A retry from the same rank counts once.
    assert destinations.register("r", 2, ("tcp://a:1",)) == []
    got: list[list[str]] = []

    async def wait() -> None:
        got.append(await destinations.wait_complete("r", 30))

    async with anyio.create_task_group() as group:
        group.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        destinations.register("r", 2, ("tcp://b:2",))
    assert got == [["tcp://a:1", "tcp://b:2"]]
    destinations.finish("r")
    with pytest.raises(BadRequestError, match="not active"):
        destinations.register("r", 2, ("tcp://c:3",))


async def test_a_different_count_is_refused() -> None:
    destinations = PushDestinations(ttl_s=60)
    destinations.register("r", 2, ("tcp://a:1",))
    with pytest.raises(BadRequestError, match="Inconsistent receive_count: 3 after 2"):
        destinations.register("r", 3, ("tcp://b:2",))


@pytest.mark.virtual_time
async def test_the_wait_is_bounded_and_stale_entries_are_pruned() -> None:
    destinations = PushDestinations(ttl_s=10)
    destinations.register("r", 2, ("tcp://a:1",))
    with pytest.raises(RequestTimeoutError, match="1 of 2 scheduler destinations"):
        await destinations.wait_complete("r", 5)
    destinations.register("orphan", 1, ("tcp://o:1",))
    assert len(destinations) == 2
    await anyio.sleep(11)  # virtual time: past every entry's ttl
    destinations.get("new")
    assert len(destinations) == 1


async def test_a_failed_part_is_remembered_for_late_ranks() -> None:
    destinations = PushDestinations(ttl_s=60)
    destinations.register("r", 2, ("tcp://a:1",))
    assert destinations.finish("r", ("bad image", 400)) == ["tcp://a:1"]
    # A late rank may still register, to be told of the failure.
    assert destinations.register("r", 2, ("tcp://b:2",)) == ["tcp://b:2"]
    assert destinations.get("r").failure == ("bad image", 400)
