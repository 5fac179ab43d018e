"""Message types: HTTP bodies, worker messages and metrics snapshots decode strictly and
round-trip through their wire form."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from encdisagg import (
    BadRequestError,
    EncodeResult,
    EncoderStats,
    Modality,
    MooncakeDestination,
    NotFoundError,
    RequestTimeoutError,
    ZmqDestination,
)
from encdisagg.server import (
    EncodeBody,
    EncoderMetrics,
    MetadataBody,
    MetricsSnapshot,
    ReceiveUrlBody,
    ReleaseBody,
    SendBody,
    ServerMetrics,
    ServiceSnapshot,
    WorkerStatus,
)
from encdisagg.server._dp._ipc import (
    ControlMessage,
    MalformedMessage,
    ReplyMessage,
    WorkMessage,
    error_from_wire,
    error_to_wire,
    pack,
    unpack,
)
from encdisagg.server._messages import result_from_wire, result_json, result_to_wire

RESULT = EncodeResult("r", 4, 8, "float16", 64, (3, 1), ((1, 2, 6), (1, 2, 2)))


def test_encode_body_defaults_and_request() -> None:
    body = EncodeBody.from_json({"req_id": "r", "mm_items": ["abc", {"url": "u"}]})
    assert (body.modality, body.num_parts, body.part_idx, body.hashes) == ("image", 1, 0, None)
    request = body.to_request()
    assert request.kind is Modality.IMAGE
    assert list(request.items) == ["abc", {"url": "u"}]
    assert EncodeBody.from_json(body.to_wire()) == body
    hashed = EncodeBody.from_json(
        {"req_id": "r", "mm_items": ["a"], "hashes": ["h"], "modality": "Video"}
    )
    assert hashed.hashes == ("h",)
    assert EncodeBody.from_json(hashed.to_wire()) == hashed
    assert EncodeBody.from_json({"req_id": "r", "mm_items": ["a"], "hashes": None}).hashes is None


def test_errors_carry_the_req_id_once_known() -> None:
    with pytest.raises(BadRequestError) as caught:
        EncodeBody.from_json({"req_id": "known", "mm_items": [], "x": 1})
    assert caught.value.req_id == "known"
    assert "'x'" in caught.value.message
    with pytest.raises(BadRequestError) as caught:
        EncodeBody.from_json({"req_id": 5, "mm_items": ["a"]})
    assert caught.value.req_id is None


def test_send_body_destinations_round_trip() -> None:
    zmq_body = SendBody.from_json({"req_id": "r", "receive_url": "10.0.0.1:5000"})
    assert zmq_body.destination == ZmqDestination("tcp://10.0.0.1:5000")
    assert SendBody.from_json(zmq_body.to_wire()) == zmq_body
    mooncake = SendBody.from_json(
        {
            "req_id": "r",
            "session_id": "10.0.0.2:17001",
            "buffer_address": 1 << 40,
            "prefill_host": "10.0.0.2",
            "embedding_port": 6000,
            "receive_count": 2,
        }
    )
    assert mooncake.destination == MooncakeDestination("10.0.0.2:17001", 1 << 40, "10.0.0.2:6000")
    assert mooncake.receive_count == 2
    assert SendBody.from_json(mooncake.to_wire()) == mooncake


def test_receive_url_body_normalises_and_dedupes() -> None:
    body = ReceiveUrlBody.from_json(
        {
            "req_id": "r",
            "receive_count": 2,
            "receive_url": ["h:1", "tcp://h:1", "[::1]:2"],
            "modality": "image",
        }
    )
    assert body.receive_urls == ("tcp://h:1", "tcp://[::1]:2")
    assert ReceiveUrlBody.from_json(body.to_wire()) == body


def test_small_bodies() -> None:
    assert MetadataBody.from_json({"req_id": "r", "part_idx": 3}) == MetadataBody("r", 3)
    assert ReleaseBody.from_json({"req_id": "r"}).to_wire() == {"req_id": "r"}
    assert MetadataBody.from_json(MetadataBody("r", 1).to_wire()) == MetadataBody("r", 1)


def test_results() -> None:
    assert result_from_wire(result_to_wire(RESULT)) == RESULT
    assert result_json(RESULT, 2) == {
        "req_id": "r",
        "part_idx": 2,
        "embedding_size": 64,
        "embedding_len": 4,
        "embedding_dim": 8,
        "token_counts": [3, 1],
        "grid": [[1, 2, 6], [1, 2, 2]],
    }
    wire = result_to_wire(RESULT)
    for broken in (
        {**wire, "extra": 1},
        {**wire, "nbytes": True},
        {**wire, "token_counts": [1.5]},
        {**wire, "grid": [3]},
        {k: v for k, v in wire.items() if k != "dtype"},
    ):
        with pytest.raises(BadRequestError):
            result_from_wire(broken)


def test_worker_messages_round_trip() -> None:
    work = WorkMessage(7, "encode", {"req_id": "r"})
    assert WorkMessage.from_wire(unpack(pack(work.to_wire()))) == work
    for control in (
        ControlMessage("cancel", id=3),
        ControlMessage("release", req_id="r"),
        ControlMessage("stop"),
    ):
        assert ControlMessage.from_wire(unpack(pack(control.to_wire()))) == control
    ready = ReplyMessage("ready", 1, pid=42)
    assert ReplyMessage.from_wire(unpack(pack(ready.to_wire()))) == ready
    value = ReplyMessage("result", 0, id=9, value={"ok": True})
    assert ReplyMessage.from_wire(unpack(pack(value.to_wire()))) == value
    failed = ReplyMessage.from_wire(
        unpack(
            pack(ReplyMessage("result", 0, id=9, error=NotFoundError("gone", req_id="r")).to_wire())
        )
    )
    assert isinstance(failed.error, NotFoundError)
    assert (failed.error.message, failed.error.req_id, failed.error.status) == ("gone", "r", 404)


def test_error_wire_keeps_our_classes_only() -> None:
    class Special(RequestTimeoutError):
        pass

    wire = error_to_wire(Special("slow", req_id="r"))
    assert wire["type"] == "RequestTimeoutError"
    assert isinstance(error_from_wire(wire), RequestTimeoutError)
    for bad in (
        {"type": "SystemExit", "message": "x", "req_id": None},
        {"type": "BadRequestError", "message": 1, "req_id": None},
        {"type": "BadRequestError", "message": "x"},
        "BadRequestError",
    ):
        with pytest.raises(MalformedMessage):
            error_from_wire(bad)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({1: 2}),
        msgpack.packb({"id": 1, "op": "encode"}),
        msgpack.packb({"id": 1, "op": "format_disk", "args": {}}),
        msgpack.packb({"id": -1, "op": "encode", "args": {}}),
        msgpack.packb({"id": True, "op": "encode", "args": {}}),
        msgpack.packb({"id": 1, "op": "encode", "args": []}),
        msgpack.packb({"id": 1, "op": "encode", "args": {}, "more": 1}),
        msgpack.packb(msgpack.ExtType(1, b"x")),
    ],
)
def test_malformed_work_messages(data: bytes) -> None:
    with pytest.raises(MalformedMessage):
        WorkMessage.from_wire(unpack(data))


@pytest.mark.parametrize(
    "message",
    [
        {"kind": "result", "rank": 0, "id": 1},
        {"kind": "result", "rank": 0, "id": 1, "value": 1, "error": None},
        {"kind": "result", "rank": "0", "id": 1, "value": 1},
        {"kind": "ready", "rank": 0},
        {"kind": "ready", "rank": 0, "pid": 1, "x": 2},
        {"kind": "hello", "rank": 0},
        {"op": "cancel"},
    ],
)
def test_malformed_replies(message: dict[str, Any]) -> None:
    with pytest.raises(MalformedMessage):
        ReplyMessage.from_wire(message)


@pytest.mark.parametrize(
    "message",
    [{"op": "cancel"}, {"op": "cancel", "id": "1"}, {"op": "release"}, {"op": "stop", "id": 1}],
)
def test_malformed_control(message: dict[str, Any]) -> None:
    with pytest.raises(MalformedMessage):
        ControlMessage.from_wire(message)


def test_metrics_snapshot_wire_and_merge() -> None:
    metrics = EncoderMetrics()
    events = metrics.events()
    assert events.on_request_done is not None
    assert events.on_phase is not None
    events.on_request_done("image", "ok", 0.02)
    events.on_request_done("image", "ok", 0.5)
    events.on_request_done("video", "bad_request", 0.001)
    events.on_phase("preprocess", 0.003)
    events.on_phase("forward", 2.0)
    events.on_phase("made-up", 1.0)
    snapshot = metrics.snapshot(None)
    assert snapshot.requests == {("image", "ok"): 2, ("video", "bad_request"): 1}
    again = MetricsSnapshot.from_wire(unpack(pack(snapshot.to_wire())))
    assert again.requests == snapshot.requests
    merged = MetricsSnapshot.merge([snapshot, again])
    assert merged.requests[("image", "ok")] == 4
    assert sum(merged.histograms["request"].counts) == 6
    assert merged.histograms["forward"].total == pytest.approx(4.0)

    server = ServerMetrics()
    server.observe_http("/encode", 200, 0.01)
    server.update(ServiceSnapshot(merged, (WorkerStatus(0, True, 2), WorkerStatus(1, False, 0)), 3))
    text = server.render().decode()
    assert 'encdisagg_requests_total{modality="image",status="ok"} 4.0' in text
    assert 'encdisagg_request_seconds_bucket{le="0.025"} 4.0' in text
    assert 'encdisagg_request_seconds_bucket{le="+Inf"} 6.0' in text
    assert "encdisagg_forward_seconds_sum 4.0" in text
    assert 'encdisagg_dp_worker_up{rank="1"} 0.0' in text
    assert 'encdisagg_dp_pending{rank="0"} 2.0' in text
    assert "encdisagg_dp_malformed_messages_total 3.0" in text
    assert 'encdisagg_http_requests_total{code="200",route="/encode"} 1.0' in text
    # Ours are prefixed; process_* is the standard process collector's, named by convention.
    assert all(
        line.startswith(("#", "encdisagg_", "process_")) for line in text.splitlines() if line
    ), "every metric is prefixed"


def test_metrics_show_the_global_cache_tier() -> None:
    stats = EncoderStats(
        live_requests=1,
        staged_bytes=64,
        inflight_transfers=0,
        registered_regions=1,
        cache_entries=2,
        held_bytes=0,
    )
    local = SimpleNamespace(hits=3, misses=4, evictions=0)
    tier = SimpleNamespace(
        breaker="open",
        hits=5,
        misses=6,
        fallbacks=7,
        skipped=8,
        invalid=1,
        inserts=9,
        insert_failures=2,
    )
    encoder: Any = SimpleNamespace(
        stats=lambda: stats,
        cache=SimpleNamespace(stats=lambda: local),
        global_cache_stats=lambda: tier,
    )
    snapshot = EncoderMetrics().snapshot(encoder)
    again = MetricsSnapshot.from_wire(unpack(pack(snapshot.to_wire())))
    server = ServerMetrics()
    server.update(ServiceSnapshot(MetricsSnapshot.merge([again]), (), None))
    text = server.render().decode()
    assert "encdisagg_cache_hits_total 3.0" in text
    assert "encdisagg_cache_global_hits_total 5.0" in text
    assert "encdisagg_cache_global_fallbacks_total 7.0" in text
    assert "encdisagg_cache_global_insert_failures_total 2.0" in text
    assert "encdisagg_global_cache_breaker_open 1.0" in text


@pytest.mark.parametrize(
    "wire",
    [
        {},
        {"requests": [], "histograms": {}, "gauges": {}},
        {"requests": [["image", "ok"]], "histograms": {}, "gauges": {}, "cache": {}},
        {"requests": [], "histograms": {"nope": [[0], 0]}, "gauges": {}, "cache": {}},
        {"requests": [], "histograms": {"forward": [[0], 0.0]}, "gauges": {}, "cache": {}},
        {"requests": [], "histograms": {}, "gauges": {"live_requests": -1}, "cache": {}},
        {"requests": [], "histograms": {}, "gauges": {"x": 1}, "cache": {}},
        {"requests": [], "histograms": {}, "gauges": {}, "cache": {"hits": True}},
    ],
)
def test_malformed_snapshots(wire: dict[str, Any]) -> None:
    with pytest.raises(BadRequestError):
        MetricsSnapshot.from_wire(wire)
