"""The fleet end to end: real etcd, real encoder servers registering, a client watching."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import torch

from encdisagg import Encoder, EncoderConfig
from encdisagg.models import NullVisionModel
from encdisagg.pipeline import serve_asgi
from encdisagg.receiver import (
    EmbeddingReceiver,
    EncoderClient,
    EncoderFleet,
    FleetRouting,
    fetch_embeddings,
    fetch_from_fleet,
)
from encdisagg.registry import EncoderLoad, EtcdClient, Registration
from tests.registry._etcd_server import EtcdServer, needs_etcd

from ._encoder_app import Faults, FaultyApp
from ._fleet_support import MODEL, Hold, etcd, expected, fleet_encoder

pytestmark = [pytest.mark.anyio, needs_etcd]
__all__ = ["etcd"]

WAIT_S = 15.0
LEAST = FleetRouting(routing="least_loaded")


def receiver() -> EmbeddingReceiver:
    return EmbeddingReceiver(transport="zmq", hidden_size=MODEL.hidden_size, dtype=MODEL.dtype)


def calls(faults: Faults, route: str) -> list[str | None]:
    return [req_id for path, req_id in faults.calls if path == route]


async def light() -> EncoderLoad:
    return EncoderLoad(0, 0)


async def heavier() -> EncoderLoad:
    return EncoderLoad(queue_depth=4, staged_bytes=0)


async def fetch_x(client: EncoderClient, rx: EmbeddingReceiver, done: anyio.Event) -> None:
    """Request ``r`` of one image ``x`` over the fleet, check it byte-exact, set ``done``."""
    async with fetch_from_fleet(client, rx, "r", {"image": ["x"]}) as got:
        assert torch.equal(got.parts[0].tensor, expected(["x"]))
    done.set()


async def revoke_lease(registration: Registration) -> None:
    """End ``registration``'s lease, as etcd does when the TTL passes without a renewal."""
    assert registration._lease is not None
    async with EtcdClient(registration.registry) as etcd_client:
        await etcd_client.revoke(registration._lease)


async def test_the_client_follows_encoders_joining_and_leaving(etcd: EtcdServer) -> None:
    registry = etcd.registry()
    async with EncoderClient(registry=registry, model="null") as client:
        fleet = client.fleet
        assert fleet is not None
        assert client.urls == ()
        async with fleet_encoder(registry) as (url_a, _, _, _):
            with anyio.fail_after(WAIT_S):
                await fleet.wait_for(1)
            assert client.urls == (url_a,)
            async with fleet_encoder(registry) as (url_b, _, _, _):
                with anyio.fail_after(WAIT_S):
                    await fleet.wait_for(2)
                assert set(client.urls) == {url_a, url_b}
            # Leaving withdrew B's key: the watch took it out.
            with anyio.fail_after(WAIT_S):
                while url_b in fleet.view:
                    await fleet.view.wait_changed()
            assert client.urls == (url_a,)


async def test_requests_flow_over_the_fleet_byte_exact(etcd: EtcdServer) -> None:
    registry = etcd.registry()
    async with (
        fleet_encoder(registry) as (_, faults_a, _, _),
        fleet_encoder(registry) as (_, faults_b, _, _),
        # Least-loaded: each request's two items go to both idle encoders.
        EncoderClient(registry=EncoderFleet(registry, routing=LEAST)) as client,
        receiver() as rx,
    ):
        assert client.fleet is not None
        with anyio.fail_after(WAIT_S):
            await client.fleet.wait_for(2)

        async def one(index: int) -> None:
            items = [f"img-{index}-a", f"img-{index}-b"]
            async with fetch_from_fleet(client, rx, f"r{index}", {"image": items}) as got:
                assert got.rid == f"r{index}"
                parts = [expected([item]) for item in items]
                joined = got.of("image")
                assert joined is not None
                assert torch.equal(joined.tensor, torch.cat(parts))

        async with anyio.create_task_group() as group:
            for index in range(8):
                group.start_soon(one, index)
        # Every request used both encoders (two items, two idle encoders).
        assert len(calls(faults_a, "/send")) == len(calls(faults_b, "/send")) == 8
        # The plain fetch plans over the fleet too (without failover).
        async with fetch_embeddings(client, rx, "plain", {"image": ["p"]}) as got:
            assert torch.equal(got.parts[0].tensor, expected(["p"]))
        assert rx.stats().stale_parts_dropped == 0


async def test_parts_go_where_the_reported_load_is_lowest(etcd: EtcdServer) -> None:
    registry = etcd.registry()

    async def busy() -> EncoderLoad:
        return EncoderLoad(queue_depth=100, staged_bytes=1 << 30)

    async with (
        fleet_encoder(registry, load=busy) as (url_busy, faults_busy, _, _),
        fleet_encoder(registry) as (url_idle, faults_idle, _, _),
        EncoderClient(registry=registry) as client,
        receiver() as rx,
    ):
        fleet = client.fleet
        assert fleet is not None
        with anyio.fail_after(WAIT_S):
            await fleet.wait_for(2)
            while fleet.load(url_busy) < 1:
                await fleet.view.wait_changed()
        for index in range(6):
            async with fetch_from_fleet(client, rx, f"r{index}", {"image": ["x"]}):
                pass
        assert len(calls(faults_idle, "/encode")) == 6
        assert calls(faults_busy, "/encode") == []
        assert fleet.load(url_idle) < fleet.load(url_busy)


async def test_a_503_is_failed_over_under_a_fresh_part_id(etcd: EtcdServer) -> None:
    registry = etcd.registry()
    refusing = Faults(fail={"/encode": 503})

    async with (
        fleet_encoder(registry, faults=refusing, load=light) as (url_a, _, _, _),
        fleet_encoder(registry, load=heavier) as (_, faults_b, _, _),
        EncoderClient(registry=registry) as client,
        receiver() as rx,
    ):
        fleet = client.fleet
        assert fleet is not None
        with anyio.fail_after(WAIT_S):
            await fleet.wait_for(2)
        async with fetch_from_fleet(client, rx, "r", {"image": ["x"]}) as got:
            assert torch.equal(got.parts[0].tensor, expected(["x"]))
        assert calls(refusing, "/encode") == ["r#0"]
        # The abandoned part was released on the encoder that refused it.
        assert calls(refusing, "/release") == ["r#0"]
        assert calls(faults_b, "/encode") == ["r#~1#0"]
        assert fleet.is_suspect(url_a)
        stats = rx.stats()
        assert (stats.parts_received, stats.stale_parts_dropped) == (1, 0)


async def test_an_encoder_whose_lease_ends_mid_encode_is_failed_over(etcd: EtcdServer) -> None:
    registry = etcd.registry()

    # retry_s: once its lease is gone, the stalled encoder does not come back in this test.
    async with (
        fleet_encoder(registry, hold="refuse", load=light, retry_s=60.0) as (url_a, _, reg_a, gate),
        fleet_encoder(registry, load=heavier) as (_, faults_b, _, _),
        EncoderClient(registry=registry) as client,
        receiver() as rx,
        anyio.create_task_group() as group,
    ):
        fleet = client.fleet
        assert fleet is not None
        assert gate is not None
        with anyio.fail_after(WAIT_S):
            await fleet.wait_for(2)
        done = anyio.Event()
        group.start_soon(fetch_x, client, rx, done)
        with anyio.fail_after(WAIT_S):
            await gate.wait_held()
        # The encoder stalls with the part; its lease ends.
        await revoke_lease(reg_a)
        with anyio.fail_after(WAIT_S):
            await done.wait()
        assert url_a not in fleet.view
        assert calls(faults_b, "/encode") == ["r#~1#0"]
        assert rx.stats().parts_received == 1


async def test_a_part_sent_but_lost_with_its_encoder_is_failed_over(etcd: EtcdServer) -> None:
    registry = etcd.registry()

    # A's /send answers 200 and pushes nothing: the message died queued in a killed process.
    lost = Faults(fail={"/send": 200})
    async with (
        fleet_encoder(registry, faults=lost, load=light, retry_s=60.0) as (url_a, _, reg_a, _),
        fleet_encoder(registry, load=heavier) as (_, faults_b, _, _),
        EncoderClient(registry=registry) as client,
        receiver() as rx,
        anyio.create_task_group() as group,
    ):
        fleet = client.fleet
        assert fleet is not None
        with anyio.fail_after(WAIT_S):
            await fleet.wait_for(2)
        done = anyio.Event()
        group.start_soon(fetch_x, client, rx, done)
        with anyio.fail_after(WAIT_S):
            while calls(lost, "/send") != ["r#0"]:
                await anyio.wait_all_tasks_blocked()
        await revoke_lease(reg_a)
        with anyio.fail_after(WAIT_S):
            await done.wait()
        assert url_a not in fleet.view
        assert calls(faults_b, "/encode") == ["r#~1#0"]
        assert rx.stats().parts_received == 1


async def test_a_draining_encoder_takes_no_new_parts_and_finishes_its_own(
    etcd: EtcdServer,
) -> None:
    registry = etcd.registry()

    async with (
        fleet_encoder(registry, hold="serve", load=light) as (url_a, faults_a, reg_a, gate),
        fleet_encoder(registry, load=heavier) as (url_b, faults_b, _, _),
        EncoderClient(registry=registry) as client,
        receiver() as rx,
        anyio.create_task_group() as group,
    ):
        fleet = client.fleet
        assert fleet is not None
        assert gate is not None
        with anyio.fail_after(WAIT_S):
            await fleet.wait_for(2)
        done = anyio.Event()
        group.start_soon(fetch_x, client, rx, done)
        with anyio.fail_after(WAIT_S):
            await gate.wait_held()
        # The encoder drains: it says so, then its key goes; its part is still in flight.
        await reg_a.withdraw()
        with anyio.fail_after(WAIT_S):
            while url_a in fleet.view:
                await fleet.view.wait_changed()
        assert url_a in fleet.view.drained
        assert fleet.urls == (url_b,)
        gate.open()
        with anyio.fail_after(WAIT_S):
            await done.wait()
        # Finished where it was, not failed over.
        assert calls(faults_a, "/send") == ["r#0"]
        assert calls(faults_b, "/encode") == []


@asynccontextmanager
async def held_encoder() -> AsyncIterator[tuple[str, Hold]]:
    """An encoder server outside the registry whose ``/encode`` waits for its gate."""
    config = EncoderConfig(request_timeout_s=30.0, send_timeout_s=30.0)
    async with Encoder(config, model=NullVisionModel()) as encoder:
        gate = Hold(FaultyApp(encoder, Faults()), refuse=False)
        try:
            async with serve_asgi(gate) as url:
                yield url, gate
        finally:
            gate.open()


async def test_a_failover_never_takes_the_id_of_a_callers_own_request(etcd: EtcdServer) -> None:
    registry = etcd.registry()
    refusing = Faults(fail={"/encode": 503})

    async with (
        fleet_encoder(registry, faults=refusing, load=light) as (_, _, _, _),
        fleet_encoder(registry, load=heavier) as (_, faults_b, _, _),
        held_encoder() as (url_c, gate),
        EncoderClient(registry=registry) as client,
        EncoderClient([url_c]) as client_c,
        receiver() as rx,
        anyio.create_task_group() as group,
    ):
        fleet = client.fleet
        assert fleet is not None
        with anyio.fail_after(WAIT_S):
            await fleet.wait_for(2)
        # The caller's own request "r~1" (the id a failover of "r" once took) is expected,
        # its part held on an encoder of its own, while "r" fails over.
        own_done = anyio.Event()

        async def fetch_own() -> None:
            async with fetch_embeddings(client_c, rx, "r~1", {"image": ["y"]}) as got:
                assert got.rid == "r~1"
                assert torch.equal(got.parts[0].tensor, expected(["y"]))
            own_done.set()

        group.start_soon(fetch_own)
        with anyio.fail_after(WAIT_S):
            await gate.wait_held()
        async with fetch_from_fleet(client, rx, "r", {"image": ["x"]}) as got:
            assert got.rid == "r"
            assert torch.equal(got.parts[0].tensor, expected(["x"]))
        assert calls(refusing, "/encode") == ["r#0"]
        assert calls(faults_b, "/encode") == ["r#~1#0"]
        gate.open()
        with anyio.fail_after(WAIT_S):
            await own_done.wait()
        stats = rx.stats()
        assert (stats.parts_received, stats.stale_parts_dropped) == (2, 0)
