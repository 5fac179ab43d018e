"""EncoderFleet's least-loaded routing decisions over a view filled by hand (no etcd needed).

Affine routing (the default) has its own tests, ``test_routing.py``."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest
import torch

from encdisagg import BadRequestError, Modality, ServiceUnavailableError
from encdisagg.receiver import (
    EmbeddingReceiver,
    EncoderClient,
    EncoderFleet,
    FleetRouting,
    fetch_from_fleet,
)
from encdisagg.registry import EncoderLoad, EncoderRecord, KeyValue

pytestmark = pytest.mark.anyio

REGISTRY = "etcd://127.0.0.1:1/fleet"
ALL = (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO)
LEAST = FleetRouting(routing="least_loaded")


def record(
    port: int,
    depth: int = 0,
    *,
    capacity: int = 8,
    model: str = "null",
    modalities: tuple[Modality, ...] = ALL,
    staged: int = 0,
) -> EncoderRecord:
    return EncoderRecord(
        url=f"http://127.0.0.1:{port}",
        model=model,
        modalities=modalities,
        transfers=("zmq",),
        capacity=capacity,
        load=EncoderLoad(queue_depth=depth, staged_bytes=staged),
    )


def publish(fleet: EncoderFleet, *records: EncoderRecord) -> None:
    """What a read of the prefix would put in the view."""
    view = fleet.view
    entries = [
        KeyValue(f"/fleet/{r.url}", r.to_json(), view.revision + 1 + i)
        for i, r in enumerate(records)
    ]
    view.reset(view.revision + len(records), entries, anyio.current_time())


async def test_a_part_goes_to_the_least_loaded_encoder() -> None:
    fleet = EncoderFleet(REGISTRY, routing=LEAST)
    publish(fleet, record(1, depth=5), record(2, depth=0), record(3, depth=2))
    plan = fleet.plan("r", {"image": ["a"]})
    assert [part.url for part in plan.parts] == ["http://127.0.0.1:2"]
    # Load is relative to capacity: 4 of 64 is lighter than 1 of 8.
    fleet = EncoderFleet(REGISTRY, routing=LEAST)
    publish(fleet, record(1, depth=1), record(2, depth=4, capacity=64))
    assert fleet.plan("r", {"image": ["a"]}).parts[0].url == "http://127.0.0.1:2"


async def test_parts_sent_since_the_last_report_count_until_a_new_one_arrives() -> None:
    fleet = EncoderFleet(REGISTRY, routing=LEAST)
    publish(fleet, record(1), record(2), record(3))
    chosen = Counter(fleet.plan(f"r{i}", {"image": ["a"]}).parts[0].url for i in range(30))
    # The reports said idle each time; what this client sent meanwhile spreads the load.
    assert sorted(chosen.values()) == [10, 10, 10]
    assert fleet.load("http://127.0.0.1:1") == 10 / 8
    # A fresh report replaces what was counted locally.
    publish(fleet, record(1, depth=1), record(2), record(3))
    assert fleet.load("http://127.0.0.1:1") == 1 / 8
    assert fleet.load("http://127.0.0.1:9") == float("inf")


async def test_items_are_cut_over_the_best_encoders_with_affinity_across_modalities() -> None:
    fleet = EncoderFleet(REGISTRY, routing=LEAST)
    publish(fleet, record(1), record(2), record(3))
    plan = fleet.plan("req", {"image": ["i0", "i1", "i2", "i3"], "video": ["v0", "v1"]})
    images = [p for p in plan.parts if p.modality is Modality.IMAGE]
    videos = [p for p in plan.parts if p.modality is Modality.VIDEO]
    assert [p.items for p in images] == [("i0", "i1"), ("i2",), ("i3",)]
    assert [p.first_item for p in images] == [0, 2, 3]
    assert [p.part_idx for p in plan.parts] == list(range(5))
    assert {p.num_parts for p in plan.parts} == {5}
    # One request ranks the encoders alike for every modality.
    assert [p.url for p in videos] == [p.url for p in images][:2]
    assert len({p.url for p in images}) == 3
    capped = EncoderFleet(REGISTRY, max_parts=2, routing=LEAST)
    publish(capped, record(1), record(2), record(3))
    assert len(capped.plan("req", {"image": ["a", "b", "c"]}).parts) == 2


async def test_only_encoders_of_the_model_and_modality_are_candidates() -> None:
    fleet = EncoderFleet(REGISTRY, model="null", routing=LEAST)
    publish(
        fleet,
        record(1, modalities=(Modality.IMAGE,)),
        record(2, model="tiny"),
        record(3, modalities=(Modality.AUDIO,), depth=7),
    )
    assert fleet.plan("r", {"audio": ["x"]}).parts[0].url == "http://127.0.0.1:3"
    assert fleet.plan("s", {"image": ["x", "y"]}).parts[0].url == "http://127.0.0.1:1"
    assert fleet.urls == ("http://127.0.0.1:1", "http://127.0.0.1:3")
    with pytest.raises(ServiceUnavailableError, match="serves video"):
        fleet.plan("t", {"video": ["x"]})
    with pytest.raises(BadRequestError, match="rid"):
        fleet.plan("a#b", {"image": ["x"]})
    with pytest.raises(BadRequestError, match="no media"):
        fleet.plan("u", {"image": []})


async def test_a_failed_encoder_is_left_out_until_it_reports_again() -> None:
    fleet = EncoderFleet(REGISTRY, routing=LEAST)
    publish(fleet, record(1), record(2, depth=3))
    fleet.mark_failed("http://127.0.0.1:1")
    assert fleet.is_suspect("http://127.0.0.1:1")
    assert fleet.plan("r", {"image": ["a"]}).parts[0].url == "http://127.0.0.1:2"
    with pytest.raises(ServiceUnavailableError):
        fleet.plan("r", {"image": ["a"]}, exclude={"http://127.0.0.1:2"})
    # A new record from it (it is alive and renewing) clears the suspicion.
    publish(fleet, record(1), record(2, depth=3))
    assert not fleet.is_suspect("http://127.0.0.1:1")
    assert fleet.plan("r", {"image": ["a"]}).parts[0].url == "http://127.0.0.1:1"


async def test_a_failover_attempt_is_named_with_characters_no_caller_may_use() -> None:
    fleet = EncoderFleet(REGISTRY, routing=LEAST)
    publish(fleet, record(1))
    attempt = fleet._plan_attempt("r", 1, {"image": ["a"]}, ())
    assert (attempt.rid, [p.req_id for p in attempt.parts]) == ("r#~1", ["r#~1#0"])
    # The caller's own "r~1" is another request; an attempt's id is not a caller's.
    assert fleet.plan("r~1", {"image": ["a"]}).rid == "r~1"
    with pytest.raises(BadRequestError, match="rid"):
        fleet.plan("r#~1", {"image": ["a"]})
    with pytest.raises(BadRequestError, match="rid"):
        fleet._plan_attempt("r#~1", 1, {"image": ["a"]}, ())


@pytest.mark.virtual_time
async def test_a_suspicion_ends_after_suspect_s() -> None:
    fleet = EncoderFleet(REGISTRY, suspect_s=5.0, routing=LEAST)
    publish(fleet, record(1))
    fleet.mark_failed("http://127.0.0.1:1")
    with pytest.raises(ServiceUnavailableError):
        fleet.plan("r", {"image": ["a"]})
    await anyio.sleep(5.0)
    assert fleet.plan("r", {"image": ["a"]}).parts[0].url == "http://127.0.0.1:1"


async def test_the_client_takes_urls_or_a_registry() -> None:
    with pytest.raises(BadRequestError, match="not both"):
        EncoderClient(["http://127.0.0.1:1"], registry=REGISTRY)
    with pytest.raises(BadRequestError, match="urls"):
        EncoderClient()
    with pytest.raises(BadRequestError, match="scheme"):
        EncoderClient(registry="http://127.0.0.1:2379")
    fleet = EncoderFleet(REGISTRY, routing=LEAST)
    client = EncoderClient(registry=fleet)
    assert client.fleet is fleet
    publish(fleet, record(1), record(2, depth=1))
    # Plans come from the fleet.
    assert client.plan("r", {"image": ["a"]}).parts[0].url == "http://127.0.0.1:1"
    assert client.urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")


async def test_fetch_from_fleet_needs_a_registry_and_sane_options() -> None:
    receiver = EmbeddingReceiver(transport="zmq", hidden_size=8, dtype=torch.float16)
    with pytest.raises(BadRequestError, match="registry"):
        async with fetch_from_fleet(EncoderClient(["http://127.0.0.1:1"]), receiver, "r", {}):
            pass
    fleet_client = EncoderClient(registry=REGISTRY)
    for options in ({"max_attempts": 0}, {"timeout_s": 0}):
        with pytest.raises(BadRequestError, match=next(iter(options))):
            async with fetch_from_fleet(fleet_client, receiver, "r", {}, **options):
                pass
