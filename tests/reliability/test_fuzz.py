"""Fuzzing: Hypothesis-generated bodies for every route of the real server, and random frames
into the ZMQ embedding receiver.

The oracle for a route is the server's own body decoder: a body it rejects must be answered
400 with the JSON error shape; a body it accepts may fail for other reasons (unknown id, a
destination nobody listens on, a wait that runs out) but never with a 500. The server
answers ``/health`` afterwards and holds nothing once the fuzzed requests are released.

Examples per route: 200 in CI, 5,000 under ``ENCDISAGG_SOAK=1``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from encdisagg import BadRequestError, Encoder, EncodeRequest, RequestNotActiveError
from encdisagg.models import NullVisionModel
from encdisagg.server import EncodeBody, MetadataBody, ReceiveUrlBody, ReleaseBody, SendBody
from encdisagg.transfer import EmbeddingHeader, ZmqReceiver, decode_header, encode_header

from ._support import fast_config, running_server, sized, wait_idle, write_soak_report

pytestmark = pytest.mark.anyio

EXAMPLES = sized(200, 5000)
KNOWN = [f"known-{index}" for index in range(8)]

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def nested(scalars: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=8,
    )


def scalars(bits: int) -> st.SearchStrategy[Any]:
    return (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**bits), max_value=2**bits)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=16)
    )


#: JSON values, with integers beyond 64 bits.
any_json = nested(scalars(70))
#: The same, within what msgpack can carry.
any_msgpack = nested(scalars(62))
req_ids = st.sampled_from(KNOWN) | st.text(max_size=12) | any_json
small_ints = st.integers(min_value=-2, max_value=4) | any_json


def bodies(
    valid: dict[str, st.SearchStrategy[Any]],
    optional: dict[str, st.SearchStrategy[Any]],
    fields: dict[str, st.SearchStrategy[Any]],
) -> st.SearchStrategy[Any]:
    """Bodies around the valid shape: valid ones, ones with a field broken, missing or
    unknown, objects with random subsets of fields, and any JSON at all."""
    good = st.fixed_dictionaries(valid, optional=optional)
    names = sorted(fields)
    broken = st.builds(
        lambda body, key, value: {**body, key: value}, good, st.sampled_from(names), any_json
    )
    missing = st.builds(
        lambda body, key: {k: v for k, v in body.items() if k != key},
        good,
        st.sampled_from(sorted(valid)),
    )
    unknown = st.builds(
        lambda body, key, value: {**body, f"x{key}": value}, good, st.text(max_size=6), any_json
    )
    shaped = st.fixed_dictionaries({}, optional=fields)
    return st.one_of(good, good, good, good, broken, missing, unknown, shaped, any_json)


def receive_urls(good: str) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.just(good),
        st.sampled_from(["tcp://127.0.0.1:1", "127.0.0.1:1", "ipc://", "tcp://", "http://x"]),
        st.text(max_size=20),
        any_json,
    )


def route_bodies(route: str, good_url: str) -> tuple[st.SearchStrategy[Any], Callable[[Any], Any]]:
    """The strategy of bodies for ``route`` and the server's decoder of them."""
    ids = st.sampled_from(KNOWN) | st.text(min_size=1, max_size=12)
    urls = st.sampled_from([good_url, good_url, "tcp://127.0.0.1:1"])
    if route == "/encode":
        items = st.lists(
            st.text(max_size=12) | st.fixed_dictionaries({"url": st.text()}) | any_json, max_size=3
        )
        fields = {
            "req_id": req_ids,
            "mm_items": items | any_json,
            "modality": st.sampled_from(["image", "VIDEO", "audio", "smell", ""]) | any_json,
            "num_parts": small_ints,
            "part_idx": small_ints,
            "hashes": st.lists(st.text(max_size=4), max_size=3) | any_json,
        }
        valid = {
            "req_id": ids,
            "mm_items": st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3),
        }
        optional = {
            "modality": st.sampled_from(["image", "video", "audio", "Image"]),
            "num_parts": st.just(2),
            "part_idx": st.integers(0, 1),
        }
        return bodies(valid, optional, fields), EncodeBody.from_json
    if route == "/send":
        fields = {
            "req_id": req_ids,
            "receive_url": receive_urls(good_url),
            "session_id": st.text(max_size=8) | any_json,
            "buffer_address": st.integers(-1, 2**64) | any_json,
            "prefill_host": st.text(max_size=8) | any_json,
            "embedding_port": st.integers(-1, 70000) | any_json,
            "receive_count": small_ints,
            "part_idx": small_ints,
            "embedding_size": small_ints,
            "embedding_len": small_ints,
            "embedding_dim": small_ints,
        }
        valid = {"req_id": ids, "receive_url": urls}
        optional = {
            "receive_count": st.integers(1, 2),
            "part_idx": st.integers(0, 3),
            "embedding_size": st.integers(0, 4096),
            "embedding_len": st.integers(0, 64),
            "embedding_dim": st.integers(0, 64),
        }
        return bodies(valid, optional, fields), SendBody.from_json
    if route == "/scheduler_receive_url":
        fields = {
            "req_id": req_ids,
            "receive_count": small_ints,
            "receive_url": receive_urls(good_url) | st.lists(receive_urls(good_url), max_size=2),
            "modality": st.sampled_from(["image", "x"]) | any_json,
        }
        valid = {"req_id": ids, "receive_count": st.integers(1, 2), "receive_url": urls}
        optional = {"modality": st.sampled_from(["image", "video"])}
        return bodies(valid, optional, fields), ReceiveUrlBody.from_json
    if route == "/scheduler_receive_meta_data":
        fields = {"req_id": req_ids, "part_idx": small_ints}
        valid = {"req_id": ids, "part_idx": st.integers(0, 3)}
        return bodies(valid, {}, fields), MetadataBody.from_json
    assert route == "/release"
    return bodies({"req_id": ids}, {}, {"req_id": req_ids}), ReleaseBody.from_json


def accepted(decode: Callable[[Any], Any], body: Any) -> bool:
    try:
        decode(body)
    except BadRequestError:
        return False
    return True


ROUTES = ["/encode", "/send", "/scheduler_receive_url", "/scheduler_receive_meta_data", "/release"]


@pytest.mark.parametrize("route", ROUTES)
async def test_fuzzed_bodies_get_no_5xx_for_malformed_input(
    route: str, anyio_backend_name: str
) -> None:
    config = fast_config(request_timeout_s=0.2, zmq_send_timeout_s=0.3, send_timeout_s=30.0)
    encoder = Encoder(config, model=NullVisionModel())
    statuses: Counter[str] = Counter()
    encoded: list[str] = []
    async with (
        running_server(encoder) as url,
        ZmqReceiver(max_queued_messages=10_000) as receiver,
        httpx.AsyncClient(base_url=url, timeout=10.0) as client,
        anyio.create_task_group() as group,
    ):

        async def drain() -> None:
            while True:
                await receiver.receive()

        group.start_soon(drain)

        async def refill() -> None:
            # Keep the known ids alive, so bodies naming them go past the lookup.
            for rid in KNOWN:
                with suppress(RequestNotActiveError):  # live already
                    await encoder.encode(EncodeRequest(rid, [rid]))

        async def post(body: Any, raw: bytes | None) -> httpx.Response:
            await refill()
            if raw is not None:
                # Declared JSON, so the body itself is what gets refused (not its type: 415).
                return await client.post(
                    route, content=raw, headers={"content-type": "application/json"}
                )
            return await client.post(
                route, content=json.dumps(body), headers={"content-type": "application/json"}
            )

        strategy, decode = route_bodies(route, receiver.url)
        raw_bodies = st.binary(max_size=64).filter(lambda data: not _is_json(data))

        json_case = strategy.map(lambda body: (body, None))
        raw_case = raw_bodies.map(lambda raw: (None, raw))

        @FUZZ_SETTINGS
        @given(st.one_of(json_case, json_case, json_case, raw_case))
        def check(case: tuple[Any, bytes | None]) -> None:
            body, raw = case
            response = anyio.from_thread.run(post, body, raw)
            well_formed = raw is None and accepted(decode, body)
            if route == "/encode" and response.status_code == 200:
                encoded.append(body["req_id"])
            statuses[f"{'ok' if well_formed else 'malformed'} {response.status_code}"] += 1
            assert response.status_code != 500, (body, raw, response.text)
            answer = response.json()
            if response.status_code >= 400:
                assert set(answer) == {"status", "message", "req_id"}, answer
                assert answer["status"] == "error"
                assert isinstance(answer["message"], str)
                assert answer["message"]
            if not well_formed:
                assert response.status_code == 400, (body, raw, response.text)

        with anyio.fail_after(sized(240, 3600)):
            await anyio.to_thread.run_sync(check)

        # Still up, and holding nothing once everything is released.
        response = await client.get("/health")
        assert response.status_code == 200, response.text
        for rid in [*KNOWN, *encoded]:
            await encoder.release(rid)
        await wait_idle(encoder)
        group.cancel_scope.cancel()
    print(f"{route}: {dict(sorted(statuses.items()))}")
    well_formed = sum(n for key, n in statuses.items() if key.startswith("ok "))
    write_soak_report(
        f"fuzz {route} ({anyio_backend_name})",
        {
            "statuses": dict(statuses),
            "headline": [
                {
                    "figure": f"fuzz {route} ({anyio_backend_name}): {statuses.total():,} bodies",
                    "value": sum(n for key, n in statuses.items() if key.endswith(" 500")),
                    "unit": "5xx on malformed / 500s",
                    "goal": "0",
                    "met": True,  # the test fails otherwise
                    "note": f"{well_formed:,} well-formed; server up and idle afterwards",
                },
            ],
        },
    )


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("route", ["/health", "/metrics"])
async def test_fuzzed_get_routes_stay_up(route: str) -> None:
    encoder = Encoder(fast_config(), model=NullVisionModel())
    async with (
        running_server(encoder) as url,
        httpx.AsyncClient(base_url=url, timeout=10.0) as client,
    ):

        async def get(params: dict[str, str], body: bytes) -> httpx.Response:
            return await client.request("GET", route, params=params, content=body)

        @settings(FUZZ_SETTINGS, max_examples=max(EXAMPLES // 4, 50))
        @given(
            st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
            st.binary(max_size=32),
        )
        def check(params: dict[str, str], body: bytes) -> None:
            response = anyio.from_thread.run(get, params, body)
            assert response.status_code == 200, response.text

        await anyio.to_thread.run_sync(check)


# -- ZMQ embedding frames -------------------------------------------------------------------

small_msgpack_ints = st.integers(min_value=-2, max_value=4) | any_msgpack
header_fields = {
    "v": st.just(1) | any_msgpack,
    "req_id": st.text(max_size=8) | any_msgpack,
    "num_parts": small_msgpack_ints,
    "part_idx": small_msgpack_ints,
    "modality": st.sampled_from(["image", "video", "x"]) | any_msgpack,
    "shape": st.lists(st.integers(-1, 8), max_size=3) | any_msgpack,
    "dtype": st.sampled_from(["float16", "bfloat16", "float32", "int7"]) | any_msgpack,
    "token_counts": st.lists(st.integers(-1, 8), max_size=3) | any_msgpack,
    "grid": st.lists(st.lists(st.integers(-1, 4), max_size=3), max_size=2) | any_msgpack,
    "error": st.none() | st.text(max_size=8) | any_msgpack,
    "status": st.none() | st.integers(0, 600) | any_msgpack,
}
header_maps = st.fixed_dictionaries({}, optional=header_fields)
header_bytes = st.one_of(
    st.binary(max_size=64),
    header_maps.map(lambda fields: msgpack.packb(fields, use_bin_type=True)),
    any_msgpack.map(lambda value: msgpack.packb(value, use_bin_type=True)),
)


@FUZZ_SETTINGS
@given(header_bytes)
def test_header_decoder_raises_only_bad_request(data: bytes) -> None:
    error: BadRequestError | None = None
    try:
        header = decode_header(data)
    except BadRequestError as exc:
        error = exc
    if error is None:
        assert isinstance(header, EmbeddingHeader)
    else:
        assert error.status == 400
        assert error.message


async def test_random_frames_into_the_receiver_give_clear_errors_only() -> None:
    outcomes: Counter[str] = Counter()
    async with ZmqReceiver(max_payload_bytes=1 << 16) as receiver:
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(receiver.url)
        try:

            @FUZZ_SETTINGS
            @given(st.lists(header_bytes | st.binary(max_size=256), min_size=1, max_size=3))
            def check(frames: list[bytes]) -> None:
                push.send_multipart(frames)
                error: BadRequestError | None = None
                try:
                    part = anyio.from_thread.run(_receive_bounded, receiver)
                except BadRequestError as exc:
                    error = exc
                if error is None:
                    outcomes["valid"] += 1
                    assert part.header.req_id is not None
                else:
                    outcomes["BadRequestError"] += 1
                    assert error.status == 400

            await anyio.to_thread.run_sync(check)

            # The receiver still takes valid messages.
            header = EmbeddingHeader(
                req_id="after",
                num_parts=1,
                part_idx=0,
                modality="image",
                shape=(2, 4),
                dtype="float16",
                token_counts=(2,),
                grid=((1, 2, 4),),
            )
            push.send_multipart([encode_header(header), bytes(16)])
            with anyio.fail_after(5):
                assert (await receiver.receive()).header.req_id == "after"
        finally:
            push.close()
            context.term()
    assert outcomes["BadRequestError"] > 0
    print(f"receiver outcomes: {dict(outcomes)}")


async def _receive_bounded(receiver: ZmqReceiver) -> Any:
    with anyio.fail_after(5):
        return await receiver.receive()
