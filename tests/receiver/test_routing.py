"""Cache-affine routing: the pure decision, the fleet's plans, and a real etcd fleet."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack

import anyio
import pytest
import torch
from PIL import Image

from encdisagg import BadRequestError
from encdisagg.receiver import (
    EmbeddingReceiver,
    EncoderClient,
    EncoderFleet,
    FleetRouting,
    affinity_key,
    fetch_from_fleet,
)
from encdisagg.receiver._routing import Slot, route_items
from encdisagg.registry import EncoderLoad
from tests.registry._etcd_server import EtcdServer, needs_etcd

from ._fleet_support import MODEL, Hold, etcd, expected, fleet_encoder
from .test_fleet_routing import REGISTRY, publish, record

__all__ = ["etcd"]

URLS = ("http://e1", "http://e2", "http://e3")


def slots(*inflight: int, capacity: int = 8) -> list[Slot]:
    return [Slot(url, count, capacity) for url, count in zip(URLS, inflight, strict=False)]


# -- the configuration ---------------------------------------------------------------------


def test_routing_defaults_to_affine_and_refuses_unknown_keys_and_bad_values() -> None:
    assert FleetRouting() == FleetRouting(routing="affine", load_bound=1.25)
    assert FleetRouting.from_mapping({"routing": "least_loaded"}).routing == "least_loaded"
    with pytest.raises(BadRequestError, match=r"unknown routing option.*load_bund"):
        FleetRouting.from_mapping({"load_bund": 2})
    with pytest.raises(BadRequestError, match="routing must be one of affine, least_loaded"):
        FleetRouting(routing="random")
    for bound in (0.9, True, float("inf"), "2"):
        with pytest.raises(BadRequestError, match="load_bound"):
            FleetRouting(load_bound=bound)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        FleetRouting().routing = "least_loaded"  # type: ignore[misc]


# -- the item's key ------------------------------------------------------------------------


def test_an_items_key_is_a_digest_of_what_the_client_holds() -> None:
    assert affinity_key(b"png") == affinity_key(bytearray(b"png"))
    assert affinity_key(b"png") != affinity_key(b"pnh")
    assert affinity_key("http://host/a.png") == affinity_key({"url": "http://host/a.png"})
    assert affinity_key({"url": "http://x/a", "content_hash": "AB"}) == affinity_key(
        {"url": "http://y/b", "content_hash": "ab"}
    )
    big = b"\x89PNG" + bytes(range(256)) * 4096
    assert affinity_key(big) == affinity_key(bytes(big))
    assert affinity_key(big) != affinity_key(big[:-1] + b"\x00"), "the tail is sampled"
    assert affinity_key(Image.new("RGB", (2, 2))) is None
    assert affinity_key([b"frame"]) is None


# -- the decision --------------------------------------------------------------------------


def test_a_key_goes_to_its_rendezvous_winner_whatever_else_is_in_the_fleet() -> None:
    winner = route_items([b"k"], slots(0, 0, 0), load_bound=1.25)[0]
    assert route_items([b"k"], slots(0, 0, 0), load_bound=1.25) == [winner]
    # Another encoder leaving does not move the key.
    others = [*[Slot(url, 0, 8) for url in URLS if url != winner][:1], Slot(winner, 0, 8)]
    assert route_items([b"k"], others, load_bound=1.25) == [winner]


def test_a_hot_key_spreads_once_its_encoder_passes_the_bound() -> None:
    fleet = slots(0, 0, 0)
    chosen = Counter(route_items([b"hot"] * 12, fleet, load_bound=1.25))
    # After 11 in flight, the 12th may raise an encoder to ceil(1.25 * 12 / 3) = 5.
    assert max(chosen.values()) <= 5
    assert len(chosen) == 3
    assert sum(slot.inflight for slot in fleet) == 12
    # A looser bound keeps more of it together.
    loose = Counter(route_items([b"hot"] * 12, slots(0, 0, 0), load_bound=3))
    assert max(loose.values()) > max(chosen.values())


def test_the_bound_is_a_share_of_capacity_and_counts_reported_load() -> None:
    winner = route_items([b"k"], slots(0, 0, 0), load_bound=1.25)[0]
    busy = [Slot(url, 6 if url == winner else 0, 8) for url in URLS]
    assert route_items([b"k"], busy, load_bound=1.25) != [winner]
    big = [Slot(url, 6 if url == winner else 0, 64 if url == winner else 8) for url in URLS]
    assert route_items([b"k"], big, load_bound=1.25) == [winner]


def test_items_without_a_key_go_to_the_least_loaded_encoder() -> None:
    assert route_items([None, None], slots(3, 1, 2), load_bound=1.25) == ["http://e2"] * 2
    with pytest.raises(ValueError, match="no encoder"):
        route_items([b"k"], [], load_bound=1.25)


# -- the fleet's plans ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_fleet_plans_each_item_by_its_key_in_runs_of_consecutive_items() -> None:
    fleet = EncoderFleet(REGISTRY)
    publish(fleet, record(1), record(2), record(3))
    first = fleet.plan("r0", {"image": ["a"]}).parts[0].url
    # Each one ended before the next was planned: nothing is in flight.
    fleet.part_finished(first)
    for index in range(1, 4):
        plan = fleet.plan(f"r{index}", {"image": ["a"]})
        assert [part.url for part in plan.parts] == [first]
        fleet.part_finished(first)
    items = ["a", "a", "b", "c", "a"]
    plan = fleet.plan("many", {"image": items})
    assert [item for part in plan.parts for item in part.items] == items
    assert [part.first_item for part in plan.parts] == sorted(p.first_item for p in plan.parts)
    for part in plan.parts:
        assert part.num_parts == len(plan.parts)
    capped = EncoderFleet(REGISTRY, max_parts=1)
    publish(capped, record(1), record(2), record(3))
    assert len(capped.plan("r", {"image": ["a", "b", "c", "d", "e"]}).parts) == 1


# -- a real etcd fleet ---------------------------------------------------------------------


async def _idle() -> EncoderLoad:
    return EncoderLoad(0, 0)


@pytest.mark.anyio
@needs_etcd
async def test_a_repeated_image_stays_on_one_encoder_and_a_hot_one_spreads(
    etcd: EtcdServer,
) -> None:
    registry = etcd.registry()
    rx = EmbeddingReceiver(transport="zmq", hidden_size=MODEL.hidden_size, dtype=MODEL.dtype)
    async with AsyncExitStack() as stack:
        encoders = [
            # Reported loads stay at zero: what routing counts is this client's own parts.
            await stack.enter_async_context(fleet_encoder(registry, hold="serve", load=_idle))
            for _ in range(3)
        ]
        client = await stack.enter_async_context(EncoderClient(registry=registry))
        await stack.enter_async_context(rx)
        fleet = client.fleet
        assert fleet is not None
        with anyio.fail_after(15):
            await fleet.wait_for(3)

        async def fetch(rid: str, item: str) -> None:
            async with fetch_from_fleet(client, rx, rid, {"image": [item]}) as got:
                assert torch.equal(got.parts[0].tensor, expected([item]))

        # Nine requests of one image at once: held at the encoders, all are in flight.
        async with anyio.create_task_group() as group:
            for index in range(9):
                group.start_soon(fetch, f"hot{index}", "hot.png")
            # Each fetch counts its part when it plans; on a busy machine a fetch may still be
            # on its way there after every other task blocked, so wait for the nine counts.
            with anyio.fail_after(10):
                while sum(fleet.load(url) for url, _, _, _ in encoders) * 8 < 9:
                    await anyio.sleep(0.01)
            inflight = {url: fleet.load(url) * 8 for url, _, _, _ in encoders}
            assert sum(inflight.values()) == 9
            # Past ceil(1.25 * 9 / 3) = 4 on one encoder, the rest went elsewhere.
            assert max(inflight.values()) <= 4
            assert sum(1 for count in inflight.values() if count) >= 2
            for _, _, _, hold in encoders:
                assert isinstance(hold, Hold)
                hold.open()
        served = {url: faults.calls for url, faults, _, _ in encoders}
        assert sum(len(calls) for calls in served.values()) >= 9
        # One image requested again and again, one at a time, goes to one encoder.
        before = {url: len(faults.calls) for url, faults, _, _ in encoders}
        for index in range(4):
            await fetch(f"repeat{index}", "repeat.png")
        grown = [url for url, faults, _, _ in encoders if len(faults.calls) > before[url]]
        assert len(grown) == 1
        assert all(fleet.load(url) == 0 for url, _, _, _ in encoders)


def test_the_client_passes_a_routing_to_the_fleet_it_builds_and_refuses_it_otherwise() -> None:
    least = FleetRouting(routing="least_loaded")
    client = EncoderClient(registry="etcd://127.0.0.1:2379/encoders", routing=least)
    assert client.fleet is not None
    assert client.fleet.routing == least
    with pytest.raises(ValueError, match="routing goes with registry="):
        EncoderClient(["http://127.0.0.1:8000"], routing=least)
