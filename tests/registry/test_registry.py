"""Registration and discovery against a real etcd server (started by the fixture)."""

from __future__ import annotations

import anyio
import anyio.to_thread
import pytest

from encdisagg import BadRequestError, Modality
from encdisagg.registry import (
    EncoderLoad,
    EncoderRecord,
    EtcdClient,
    Registration,
    RegistryWatcher,
    parse_registry_url,
)

from ._etcd_server import EtcdServer, needs_etcd, run_etcd
from ._waits import WAIT_S, wait_for


def record(url: str = "http://127.0.0.1:9001", *, capacity: int = 8) -> EncoderRecord:
    return EncoderRecord(
        url=url,
        model="null",
        modalities=(Modality.IMAGE, Modality.VIDEO),
        transfers=("zmq",),
        capacity=capacity,
    )


# -- what needs no server ------------------------------------------------------------------


def test_registry_url_parses_host_port_and_prefix() -> None:
    url = parse_registry_url("etcd://10.0.0.7:2379/fleet/a")
    assert (url.host, url.port, url.prefix) == ("10.0.0.7", 2379, "/fleet/a/")
    assert url.gateway == "http://10.0.0.7:2379"
    assert url.key("http://h:1") == "/fleet/a/http://h:1"
    assert parse_registry_url("etcd://[::1]:2379").prefix == "/encdisagg/encoders/"
    assert str(parse_registry_url("etcd://[::1]:2379/x")) == "etcd://[::1]:2379/x/"


@pytest.mark.parametrize(
    ("url", "part"),
    [
        ("http://h:2379/p", "scheme"),
        ("etcd://h/p", "port"),
        ("etcd://h:99999/p", "port"),
        ("etcd://:2379/p", "host"),
        ("etcd://h:2379/p?x=1", "query"),
        ("etcd://u:pw@h:2379/p", "user"),
        ("", "etcd://"),
    ],
)
def test_registry_url_rejects_what_it_cannot_use(url: str, part: str) -> None:
    with pytest.raises(BadRequestError, match=part) as caught:
        parse_registry_url(url, field="--registry")
    assert caught.value.message.startswith("--registry")


def test_record_round_trips_and_decodes_strictly() -> None:
    loaded = record().with_load(EncoderLoad(queue_depth=3, staged_bytes=4096))
    assert EncoderRecord.from_json(loaded.to_json()) == loaded
    assert EncoderRecord.from_json(loaded.as_draining().to_json()).draining
    body = loaded.to_json()
    for bad, field in [
        (body.replace(b'"v":1', b'"v":2'), "version"),
        (body.replace(b'"capacity":8', b'"capacity":0'), "capacity"),
        (body.replace(b'"queue_depth":3', b'"queue_depth":true'), "queue_depth"),
        (body.replace(b'"draining":false', b'"draining":0'), "draining"),
        (body.replace(b'"modalities":["image","video"]', b'"modalities":["smell"]'), "modal"),
        (body[:-1] + b',"extra":1}', "extra"),
        (b"[]", "object"),
        (b"\xff", "JSON"),
    ]:
        with pytest.raises(BadRequestError, match=field):
            EncoderRecord.from_json(bad)


# -- against etcd ---------------------------------------------------------------------------

pytestmark = [needs_etcd]


@pytest.mark.anyio
async def test_registration_puts_a_leased_key_and_watch_sees_join_refresh_and_leave(
    etcd: EtcdServer,
) -> None:
    registry = etcd.registry()
    loads = [EncoderLoad(0, 0)]

    async def load() -> EncoderLoad:
        return loads[-1]

    async with RegistryWatcher(registry) as watcher:
        await watcher.wait_synced()
        view = watcher.view
        assert len(view) == 0
        async with Registration(registry, record(), load=load, refresh_s=0.05) as registration:
            url = registration.record.url
            await wait_for(view, lambda: url in view, "the join")
            seen = view.get(url)
            assert seen is not None
            assert (seen.model, seen.capacity) == ("null", 8)
            assert seen.modalities == (Modality.IMAGE, Modality.VIDEO)
            # The key is bound to a lease.
            async with EtcdClient(parse_registry_url(registry)) as client:
                _, entries = await client.get_prefix(registration.registry.prefix)
            assert [entry.key for entry in entries] == [registration.key]
            loads.append(EncoderLoad(queue_depth=5, staged_bytes=1 << 20))
            await wait_for(
                view,
                lambda: (r := view.get(url)) is not None and r.load.queue_depth == 5,
                "the load refresh",
            )
            assert view.get(url).load.staged_bytes == 1 << 20  # type: ignore[union-attr]
            assert view.connected
        # Leaving the block withdrew it: the watch shows the leave.
        await wait_for(view, lambda: url not in view, "the leave")
        assert url in view.left_at


@pytest.mark.anyio
async def test_withdraw_removes_the_key_before_the_block_ends(etcd: EtcdServer) -> None:
    registry = etcd.registry()
    async with RegistryWatcher(registry) as watcher:
        await watcher.wait_synced()
        view = watcher.view
        async with Registration(registry, record()) as registration:
            await wait_for(view, lambda: registration.record.url in view, "the join")
            await registration.withdraw()
            assert not registration.registered
            # Withdrawn while the encoder still runs (it drains in-flight work after).
            await wait_for(view, lambda: registration.record.url not in view, "the leave")
            await registration.withdraw()  # idempotent


@pytest.mark.anyio
async def test_a_lease_nobody_renews_expires_and_its_encoder_leaves(etcd: EtcdServer) -> None:
    registry = parse_registry_url(etcd.registry())
    dead = record("http://127.0.0.1:9002")
    async with RegistryWatcher(registry) as watcher, EtcdClient(registry) as client:
        await watcher.wait_synced()
        view = watcher.view
        # What a killed encoder leaves behind: a key on a lease that nobody renews.
        lease = await client.grant(2)
        await client.put(registry.key(dead.url), dead.to_json(), lease=lease)
        await wait_for(view, lambda: dead.url in view, "the join")
        await wait_for(view, lambda: dead.url not in view, "the lease's expiry")
        assert await client.keepalive(lease) == 0


@pytest.mark.anyio
async def test_a_lost_lease_is_registered_again(etcd: EtcdServer) -> None:
    registry = etcd.registry()
    async with RegistryWatcher(registry) as watcher:
        await watcher.wait_synced()
        view = watcher.view
        async with Registration(
            registry, record(), lease_ttl_s=2, refresh_s=0.05, retry_s=0.05
        ) as registration:
            await registration.wait_registered()
            url = registration.record.url
            await wait_for(view, lambda: url in view, "the join")
            # The lease vanishes under the encoder (an operator revoked it, or it stalled
            # past its TTL): the keeper notices at its next renewal and registers again.
            async with EtcdClient(registration.registry) as client:
                assert registration._lease is not None
                await client.revoke(registration._lease)
            await wait_for(view, lambda: url not in view, "the leave")
            await wait_for(view, lambda: url in view, "the second registration")
            with anyio.fail_after(WAIT_S):
                while registration.registrations < 2:
                    await registration._registered.wait()


@pytest.mark.anyio
async def test_malformed_records_are_skipped(etcd: EtcdServer) -> None:
    registry = parse_registry_url(etcd.registry())
    async with RegistryWatcher(registry) as watcher, EtcdClient(registry) as client:
        await watcher.wait_synced()
        view = watcher.view
        await client.put(registry.key("http://x:1"), b"{not json")
        # A record under someone else's name is refused too.
        await client.put(registry.key("http://y:1"), record("http://z:1").to_json())
        good = record("http://127.0.0.1:9003")
        await client.put(registry.key(good.url), good.to_json())
        await wait_for(view, lambda: good.url in view, "the good record")
        assert set(view.records) == {good.url}
        assert view.malformed == 2


@pytest.mark.anyio
async def test_while_etcd_is_down_the_view_stays_and_registration_resumes() -> None:
    with run_etcd() as own:
        registry = own.registry()
        async with (
            RegistryWatcher(registry, retry_s=0.05, timeout_s=0.5) as watcher,
            Registration(
                registry, record(), lease_ttl_s=3, refresh_s=0.05, retry_s=0.05, timeout_s=0.5
            ) as registration,
        ):
            await watcher.wait_synced()
            view = watcher.view
            url = registration.record.url
            await wait_for(view, lambda: url in view and view.connected, "the join")
            await anyio.to_thread.run_sync(own.stop)
            await wait_for(view, lambda: not view.connected, "the watch to notice")
            # Routing goes on with the last view.
            assert url in view
            await anyio.to_thread.run_sync(own.start)
            await wait_for(view, lambda: view.connected, "the watch to resume")
            # The key survives a restart while its lease lives, or comes back registered anew.
            await wait_for(view, lambda: url in view, "the registration")
            with anyio.fail_after(WAIT_S):
                await registration.wait_registered()
