"""The SglangEncoder gRPC service over a fake of the SGLang wire's calls: each RPC's body
and answer, the error mapping, health, reflection, the API key, and cancellation (a
cancelled RPC cancels its work and ends only once that work stopped).

Real gRPC channels on loopback; the client is grpcio's blocking stub (as SGLang's own
receiver uses for Encode), driven from worker threads so the tests run on both backends.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import pytest

pytest.importorskip("grpc")
pytest.importorskip("smg_grpc_proto")
pytest.importorskip("grpc_health.v1")
pytest.importorskip("grpc_reflection.v1alpha")

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import (
    sglang_encoder_pb2 as pb,
    sglang_encoder_pb2_grpc as pb_grpc,
)

from encdisagg import BadRequestError, NotFoundError, TransferTimeoutError
from encdisagg.server._access import ApiKey, ForbiddenError
from encdisagg.server._sglang._grpc_server import GrpcServer

pytestmark = pytest.mark.anyio

SERVICE = "sglang.grpc.encoder.SglangEncoder"


class FakeCalls:
    """Records each body; ``req_id`` picks the behaviour (``"bad"``, ``"gone"``, ``"far"``,
    ``"late"``, ``"boom"``, ``"hold"`` waits for ``release``)."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict[str, object]]] = []
        self.entered = anyio.Event()
        self.release = anyio.Event()
        self.stopped = anyio.Event()
        self.cancelled = False
        self.answer: object = None

    async def _run(self, name: str, body: Mapping[str, object]) -> object:
        self.bodies.append((name, dict(body)))
        req_id = body.get("req_id")
        if req_id == "bad":
            raise BadRequestError("num_parts must be an integer >= 1")
        if req_id == "gone":
            raise NotFoundError("unknown req_id 'gone'", req_id="gone")
        if req_id == "far":
            raise ForbiddenError("prefill_host: 203.0.113.9 is not an allowed peer")
        if req_id == "late":
            raise TransferTimeoutError("req_id 'late': the write may still land", req_id="late")
        if req_id == "boom":
            raise RuntimeError("secret internals at 0x7f00")
        if req_id == "hold":
            self.entered.set()
            try:
                await self.release.wait()
            except anyio.get_cancelled_exc_class():
                self.cancelled = True
                raise
            finally:
                self.stopped.set()
        return self.answer

    async def encode(self, body: Mapping[str, object]) -> object:
        return await self._run("encode", body)

    async def send(self, body: Mapping[str, object]) -> object:
        return await self._run("send", body)

    async def scheduler_receive_url(self, body: Mapping[str, object]) -> object:
        return await self._run("scheduler_receive_url", body)


@asynccontextmanager
async def serving(calls: FakeCalls, **options: Any) -> AsyncIterator[tuple[GrpcServer, str]]:
    async with GrpcServer(calls, **options) as server:
        yield server, f"127.0.0.1:{server.port}"


def _stub(target: str) -> tuple[grpc.Channel, pb_grpc.SglangEncoderStub]:
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.SglangEncoderStub(channel)


async def _call(target: str, method: str, request: object, **kwargs: Any) -> Any:
    def run() -> Any:
        channel, stub = _stub(target)
        with channel:
            return getattr(stub, method)(request, timeout=30, **kwargs)

    return await anyio.to_thread.run_sync(run)


async def _rpc_error(target: str, method: str, request: object, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        await _call(target, method, request, **kwargs)
    return caught.value


async def test_encode_sends_sglangs_body_and_answers_the_sizes() -> None:
    calls = FakeCalls()
    calls.answer = {"req_id": "r_part_0", "embedding_size": 96, "embedding_len": 3}
    calls.answer["embedding_dim"] = 16
    request = pb.EncodeRequest(
        mm_items=["data:image/png;base64,AAAA", "http://host/x.png"],
        req_id="r_part_0",
        num_parts=2,
        part_idx=1,
        prefill_host="10.0.0.7",
        embedding_port=[30001, 30002],
    )
    async with serving(calls) as (_, target):
        response = await _call(target, "Encode", request)
    assert (response.embedding_size, response.embedding_len, response.embedding_dim) == (96, 3, 16)
    assert calls.bodies == [
        (
            "encode",
            {
                "mm_items": ["data:image/png;base64,AAAA", "http://host/x.png"],
                "modality": "IMAGE",
                "req_id": "r_part_0",
                "num_parts": 2,
                "part_idx": 1,
                "prefill_host": "10.0.0.7",
                "embedding_port": [30001, 30002],
            },
        )
    ]


async def test_encode_without_destinations_sends_nulls_and_a_null_answer_is_empty() -> None:
    calls = FakeCalls()
    async with serving(calls) as (_, target):
        response = await _call(target, "Encode", pb.EncodeRequest(req_id="r", mm_items=["x"]))
    assert response == pb.EncodeResponse()
    body = calls.bodies[0][1]
    assert body["prefill_host"] is None
    assert body["embedding_port"] is None
    # Protobuf's unset num_parts is 0: passed on, so validation refuses it as SGLang's does.
    assert body["num_parts"] == 0


async def test_send_and_scheduler_receive_url_bodies() -> None:
    calls = FakeCalls()
    send = pb.SendRequest(
        req_id="r",
        prefill_host="127.0.0.1",
        embedding_port=4000,
        session_id="127.0.0.1:17000",
        buffer_address=1 << 40,
    )
    register = pb.SchedulerReceiveUrlRequest(
        req_id="r", receive_url="127.0.0.1:5000", receive_count=2
    )
    async with serving(calls) as (_, target):
        assert await _call(target, "Send", send) == pb.SendResponse()
        assert await _call(target, "SchedulerReceiveUrl", register) == (
            pb.SchedulerReceiveUrlResponse()
        )
        await _call(target, "Send", pb.SendRequest(req_id="z", embedding_port=1))
    assert calls.bodies[0] == (
        "send",
        {
            "req_id": "r",
            "prefill_host": "127.0.0.1",
            "embedding_port": 4000,
            "session_id": "127.0.0.1:17000",
            "buffer_address": 1 << 40,
            "receive_count": 1,
        },
    )
    assert calls.bodies[1] == (
        "scheduler_receive_url",
        {"req_id": "r", "receive_url": "127.0.0.1:5000", "receive_count": 2, "modality": "IMAGE"},
    )
    # Unset Mooncake fields are protobuf zeros: sent on as absent (null).
    assert calls.bodies[2][1]["session_id"] is None
    assert calls.bodies[2][1]["buffer_address"] is None


@pytest.mark.parametrize(
    ("req_id", "code", "details"),
    [
        ("bad", grpc.StatusCode.INVALID_ARGUMENT, "num_parts must be an integer >= 1"),
        ("gone", grpc.StatusCode.INTERNAL, "unknown req_id 'gone'"),
        (
            "far",
            grpc.StatusCode.PERMISSION_DENIED,
            "prefill_host: 203.0.113.9 is not an allowed peer",
        ),
        # A transfer whose outcome is unknown is told apart from a failed one.
        (
            "late",
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "req_id 'late': the write may still land",
        ),
        ("boom", grpc.StatusCode.INTERNAL, "internal server error"),
    ],
)
async def test_errors_map_as_sglang_maps_them(
    req_id: str, code: grpc.StatusCode, details: str
) -> None:
    calls = FakeCalls()
    requests = {
        "Encode": pb.EncodeRequest(req_id=req_id),
        "Send": pb.SendRequest(req_id=req_id),
        "SchedulerReceiveUrl": pb.SchedulerReceiveUrlRequest(req_id=req_id),
    }
    async with serving(calls) as (_, target):
        for method, request in requests.items():
            error = await _rpc_error(target, method, request)
            assert error.code() == code, method
            assert error.details() == details, method


async def test_health_follows_readiness_and_reflection_lists_the_services() -> None:
    ready = [True]

    def check(target: str, service: str) -> int:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=service)
            return int(stub.Check(request, timeout=30).status)

    def listed(target: str) -> set[str]:
        with grpc.insecure_channel(target) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            answers = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
        return {s.name for s in answers[0].list_services_response.service}

    serving_status = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    async with serving(FakeCalls(), ready=lambda: ready[0]) as (_, target):
        assert await anyio.to_thread.run_sync(check, target, "") == serving_status
        assert await anyio.to_thread.run_sync(check, target, SERVICE) == serving_status
        ready[0] = False
        assert await anyio.to_thread.run_sync(check, target, SERVICE) == not_serving
        with pytest.raises(grpc.RpcError) as caught:
            await anyio.to_thread.run_sync(check, target, "no.such.Service")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        services = await anyio.to_thread.run_sync(listed, target)
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= (
        services
    )


async def test_health_watch_streams_the_change_to_not_serving() -> None:
    ready = [True]

    async with serving(FakeCalls(), ready=lambda: ready[0]) as (_, target):

        def watch() -> list[int]:
            with grpc.insecure_channel(target) as channel:
                stream = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service=""), timeout=30
                )
                seen = [int(next(stream).status)]
                ready[0] = False
                seen.append(int(next(stream).status))
                stream.cancel()
                return seen

        seen = await anyio.to_thread.run_sync(watch)
    response = health_pb2.HealthCheckResponse
    assert seen == [response.SERVING, response.NOT_SERVING]


async def test_the_api_key_guards_the_rpcs_but_not_health() -> None:
    calls = FakeCalls()
    async with serving(calls, api_key=ApiKey("s3cret")) as (_, target):
        error = await _rpc_error(target, "Encode", pb.EncodeRequest(req_id="r"))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        wrong = (("authorization", "Bearer nope"),)
        error = await _rpc_error(target, "Send", pb.SendRequest(req_id="r"), metadata=wrong)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert calls.bodies == []
        right = (("authorization", "Bearer s3cret"),)
        await _call(target, "Encode", pb.EncodeRequest(req_id="r"), metadata=right)

        def check() -> int:
            with grpc.insecure_channel(target) as channel:
                request = health_pb2.HealthCheckRequest(service="")
                return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=30).status)

        assert await anyio.to_thread.run_sync(check) == health_pb2.HealthCheckResponse.SERVING
    assert len(calls.bodies) == 1


async def test_a_cancelled_rpc_cancels_its_work_and_waits_for_it() -> None:
    calls = FakeCalls()
    async with serving(calls) as (_, target):
        channel, stub = _stub(target)
        with channel:
            future = stub.Encode.future(pb.EncodeRequest(req_id="hold"), timeout=30)
            await calls.entered.wait()
            assert future.cancel()
            await calls.stopped.wait()
    assert calls.cancelled


async def test_a_deadline_cancels_the_work() -> None:
    calls = FakeCalls()
    async with serving(calls) as (_, target):
        channel, stub = _stub(target)
        with channel:
            future = stub.Send.future(pb.SendRequest(req_id="hold"), timeout=0.5)
            error = await anyio.to_thread.run_sync(future.exception)
            assert error is not None
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await calls.stopped.wait()
    assert calls.cancelled


async def test_leaving_gives_rpcs_in_flight_their_grace_then_cancels_them() -> None:
    calls = FakeCalls()
    channel = None
    try:
        async with serving(calls, grace_s=0.2) as (_, target):
            channel, stub = _stub(target)
            future = stub.Encode.future(pb.EncodeRequest(req_id="hold"), timeout=30)
            await calls.entered.wait()
        # Left: the work was cancelled after the grace and had stopped before the exit.
        assert calls.stopped.is_set()
        assert calls.cancelled
        error = await anyio.to_thread.run_sync(future.exception)
        assert error is not None
    finally:
        if channel is not None:
            channel.close()


async def test_an_rpc_in_flight_finishes_within_the_grace() -> None:
    calls = FakeCalls()
    channel = None
    try:
        async with anyio.create_task_group() as group, serving(calls, grace_s=30) as (_, target):
            channel, stub = _stub(target)
            future = stub.Encode.future(pb.EncodeRequest(req_id="hold"), timeout=30)
            await calls.entered.wait()

            async def finish() -> None:
                # Once the exit waits for the gRPC server to stop.
                await anyio.wait_all_tasks_blocked()
                calls.release.set()

            group.start_soon(finish)
        assert not calls.cancelled
        assert await anyio.to_thread.run_sync(future.result) == pb.EncodeResponse()
    finally:
        if channel is not None:
            channel.close()


async def test_a_busy_port_fails_the_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="gRPC"):
            async with GrpcServer(FakeCalls(), port=port):
                pass
