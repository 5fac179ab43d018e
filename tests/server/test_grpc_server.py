"""``--grpc-port``: SGLang's SglangEncoder service on the real encoder server.

In process (both backends): the app's lifespan runs the gRPC server beside the routes, on
the tiny model; SGLang's two ZMQ modes push ``[header, bytes]`` to a PULL socket of the
test, byte-equal to a local encode; errors map to INVALID_ARGUMENT / INTERNAL; health turns
NOT_SERVING when a drain begins while RPCs are still served; a cancelled Encode leaves
nothing staged. In a subprocess: ``encdisagg serve --grpc-port 0`` on each worker class.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import zmq
from anyio.streams.buffered import BufferedByteReceiveStream
from quart import Quart

pytest.importorskip("grpc")
pytest.importorskip("smg_grpc_proto")
pytest.importorskip("grpc_health.v1")
pytest.importorskip("grpc_reflection.v1alpha")

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_encoder_pb2 as pb, sglang_encoder_pb2_grpc as pb_grpc

from encdisagg import Encoder, EncodeRequest, Modality, ZmqDestination
from encdisagg._cli import build_parser, main
from encdisagg._cli._serve import resolve
from encdisagg.models import NullVisionModel, Preprocessed
from encdisagg.server import EncoderService, ServerSettings
from encdisagg.server._sglang._grpc_server import GrpcServer
from encdisagg.transfer import ZmqReceiver

from ._helpers import fast_config, png_bytes, png_data_url, running

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Pull:
    """A plain PULL socket, as SGLang's receivers bind one; frames as bytes."""

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self.port = self._socket.bind_to_random_port("tcp://127.0.0.1")

    def _receive(self) -> list[bytes]:
        if not self._socket.poll(30_000):
            raise TimeoutError("nothing arrived within 30 s")
        return list(self._socket.recv_multipart())

    async def receive(self) -> list[bytes]:
        return await anyio.to_thread.run_sync(self._receive)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


@contextmanager
def pulling() -> Iterator[Pull]:
    pull = Pull()
    try:
        yield pull
    finally:
        pull.close()


def target_of(service: EncoderService) -> str:
    url = service.grpc_url
    assert url is not None
    return url.removeprefix("grpc://")


async def call(target: str, method: str, request: object) -> Any:
    def run() -> Any:
        with grpc.insecure_channel(target) as channel:
            return getattr(pb_grpc.SglangEncoderStub(channel), method)(request, timeout=60)

    return await anyio.to_thread.run_sync(run)


async def rpc_error(target: str, method: str, request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        await call(target, method, request)
    return caught.value


async def health(target: str) -> int:
    def run() -> int:
        with grpc.insecure_channel(target) as channel:
            request = health_pb2.HealthCheckRequest(service="sglang.grpc.encoder.SglangEncoder")
            return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=30).status)

    return await anyio.to_thread.run_sync(run)


async def local_bytes(image: bytes) -> bytes:
    """The embedding bytes the same seeded tiny tower gives in this process."""
    async with Encoder(fast_config()) as local, ZmqReceiver() as receiver:
        await local.encode(EncodeRequest("local", [image]))
        await local.send("local", ZmqDestination(receiver.url))
        with anyio.fail_after(30):
            part = await receiver.receive()
    assert part.tensor is not None
    return part.tensor.contiguous().view(torch.uint8).numpy().tobytes()


@asynccontextmanager
async def grpc_app(
    make_app: Callable[..., Quart], settings: dict[str, Any] | None = None, **config: Any
) -> AsyncIterator[Quart]:
    app = make_app(fast_config(**config), grpc_port=0, **(settings or {}))
    async with running(app):
        yield app


@pytest.mark.anyio
async def test_both_zmq_modes_push_what_a_local_encode_gives(
    make_app: Callable[..., Quart],
) -> None:
    image = png_bytes(64, 48, seed=3)
    expected = await local_bytes(image)
    async with grpc_app(make_app) as app:
        target = target_of(app.extensions["encdisagg"])
        with pulling() as tokenizer, pulling() as scheduler:
            # zmq_to_tokenizer: the destination comes with the Encode.
            request = pb.EncodeRequest(
                req_id="tok_part_0",
                mm_items=[png_data_url(64, 48, seed=3)],
                num_parts=1,
                part_idx=0,
                prefill_host="127.0.0.1",
                embedding_port=[tokenizer.port],
            )
            assert await call(target, "Encode", request) == pb.EncodeResponse()
            header, payload = await tokenizer.receive()
            assert payload == expected
            assert header[:1] == b"\x80"  # a pickle: SGLang's EmbeddingData header

            # zmq_to_scheduler: the rank registers first, the Encode names no port.
            register = pb.SchedulerReceiveUrlRequest(
                req_id="sch_part_0", receive_url=f"127.0.0.1:{scheduler.port}", receive_count=1
            )
            assert await call(target, "SchedulerReceiveUrl", register) == (
                pb.SchedulerReceiveUrlResponse()
            )
            request = pb.EncodeRequest(
                req_id="sch_part_0", mm_items=[png_data_url(64, 48, seed=3)], num_parts=1
            )
            assert await call(target, "Encode", request) == pb.EncodeResponse()
            _, payload = await scheduler.receive()
            assert payload == expected
        stats = app.extensions["encdisagg"].backend.encoder.stats()
        assert (stats.live_requests, stats.staged_bytes) == (0, 0)


@pytest.mark.anyio
async def test_errors_map_to_invalid_argument_and_internal(
    make_app: Callable[..., Quart],
) -> None:
    async with grpc_app(make_app, zmq_send_timeout_s=0.5) as app:
        target = target_of(app.extensions["encdisagg"])
        bad_parts = pb.EncodeRequest(req_id="r", mm_items=[png_data_url(32, 32)], num_parts=0)
        error = await rpc_error(target, "Encode", bad_parts)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_parts" in error.details()
        bad_media = pb.EncodeRequest(req_id="m", mm_items=["not an image"], num_parts=1)
        error = await rpc_error(target, "Encode", bad_media)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "mm_items[0]" in error.details()
        # Nothing listens there: the push times out, a failure of the encoder's own.
        with pulling() as pull:
            port = pull.port
        unreachable = pb.EncodeRequest(
            req_id="u",
            mm_items=[png_data_url(32, 32)],
            num_parts=1,
            prefill_host="127.0.0.1",
            embedding_port=[port],
        )
        error = await rpc_error(target, "Encode", unreachable)
        assert error.code() == grpc.StatusCode.INTERNAL
        # Send is Mooncake's; this server pushes over ZMQ.
        send = pb.SendRequest(
            req_id="u", prefill_host="127.0.0.1", embedding_port=port, session_id="h:1"
        )
        error = await rpc_error(target, "Send", send)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        stats = app.extensions["encdisagg"].backend.encoder.stats()
        assert (stats.live_requests, stats.staged_bytes) == (0, 0)


@pytest.mark.anyio
async def test_a_destination_outside_the_allowed_peers_is_permission_denied(
    make_app: Callable[..., Quart],
) -> None:
    async with grpc_app(make_app, {"allowed_peers": ("10.0.0.0/8",)}) as app:
        target = target_of(app.extensions["encdisagg"])
        request = pb.EncodeRequest(
            req_id="p",
            mm_items=[png_data_url(32, 32)],
            num_parts=1,
            prefill_host="127.0.0.1",
            embedding_port=[4000],
        )
        error = await rpc_error(target, "Encode", request)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "127.0.0.1" in error.details()
        register = pb.SchedulerReceiveUrlRequest(
            req_id="p", receive_url="127.0.0.1:4000", receive_count=1
        )
        error = await rpc_error(target, "SchedulerReceiveUrl", register)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.anyio
async def test_health_is_not_serving_once_a_drain_begins_while_rpcs_still_run(
    make_app: Callable[..., Quart],
) -> None:
    async with grpc_app(make_app) as app:
        service: EncoderService = app.extensions["encdisagg"]
        target = target_of(service)
        assert await health(target) == SERVING
        service.start_draining()
        assert await health(target) == NOT_SERVING
        with pulling() as pull:
            request = pb.EncodeRequest(
                req_id="late",
                mm_items=[png_data_url(32, 32)],
                num_parts=1,
                prefill_host="127.0.0.1",
                embedding_port=[pull.port],
            )
            await call(target, "Encode", request)
            assert len(await pull.receive()) == 2
    assert service.grpc_url is None
    error = await rpc_error(target, "Encode", request)
    assert error.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.anyio
async def test_encode_is_unavailable_once_the_drain_refuses_encodes_and_admitted_parts_go_on(
    make_app: Callable[..., Quart],
) -> None:
    async with grpc_app(make_app) as app:
        service: EncoderService = app.extensions["encdisagg"]
        target = target_of(service)
        encoder = service.backend.encoder
        with pulling() as pull:
            # Admitted before the drain: its destination is registered only afterwards.
            kept = pb.EncodeRequest(req_id="kept", mm_items=[png_data_url(32, 32)], num_parts=1)
            async with anyio.create_task_group() as group:
                group.start_soon(call, target, "Encode", kept)
                with anyio.fail_after(30):
                    while encoder.stats().live_requests < 1:
                        await anyio.sleep(0.01)
                service.refuse_encodes()
                new = pb.EncodeRequest(req_id="new", mm_items=[png_data_url(32, 32)], num_parts=1)
                error = await rpc_error(target, "Encode", new)
                assert error.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in error.details()
                register = pb.SchedulerReceiveUrlRequest(
                    req_id="kept", receive_url=f"127.0.0.1:{pull.port}", receive_count=1
                )
                await call(target, "SchedulerReceiveUrl", register)
            assert len(await pull.receive()) == 2


class GatedModel:
    """NullVisionModel whose forward waits for ``gate`` (a unit-test fake)."""

    def __init__(self) -> None:
        self._inner = NullVisionModel()
        self.gate = threading.Event()
        self.entered = threading.Event()

    @property
    def hidden_size(self) -> int:
        return self._inner.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self._inner.dtype

    def preprocess(self, items: Sequence[object], modality: Modality) -> Preprocessed:
        return self._inner.preprocess(items, modality)

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        self.entered.set()
        self.gate.wait(30)
        return self._inner.forward(batch)


class Tracked:
    """The real SGLang calls, noting when an encode ended and how."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.ended = anyio.Event()
        self.outcome: str | None = None

    async def encode(self, body: Mapping[str, object]) -> object:
        try:
            return await self._inner.encode(body)
        except anyio.get_cancelled_exc_class():
            self.outcome = "cancelled"
            raise
        finally:
            self.ended.set()

    async def send(self, body: Mapping[str, object]) -> object:
        return await self._inner.send(body)

    async def scheduler_receive_url(self, body: Mapping[str, object]) -> object:
        return await self._inner.scheduler_receive_url(body)


@pytest.mark.anyio
async def test_a_cancelled_encode_leaves_nothing_staged() -> None:
    from encdisagg.server._sglang._service import SglangService

    model = GatedModel()
    encoder = Encoder(fast_config(model="null"), model=model)
    with pulling() as pull:
        async with encoder, SglangService(encoder) as sglang:
            calls = Tracked(sglang)
            async with GrpcServer(calls) as server:
                with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                    stub = pb_grpc.SglangEncoderStub(channel)
                    request = pb.EncodeRequest(
                        req_id="gone_part_0",
                        mm_items=["anything: the null model takes it"],
                        num_parts=1,
                        prefill_host="127.0.0.1",
                        embedding_port=[pull.port],
                    )
                    future = stub.Encode.future(request, timeout=60)
                    await anyio.to_thread.run_sync(model.entered.wait, 30)
                    assert future.cancel()
                    # The cancelled encode returns while its forward still runs; only then
                    # may the forward end (else, on a loaded machine, the encode could finish
                    # before the cancellation reached it).
                    with anyio.fail_after(30):
                        await calls.ended.wait()
                    model.gate.set()
                assert calls.outcome == "cancelled"
                stats = encoder.stats()
                assert (stats.live_requests, stats.staged_bytes) == (0, 0)


def resolved(*argv: str):  # type: ignore[no-untyped-def]
    return resolve(build_parser().parse_args(["serve", *argv]))


def test_the_flag_and_the_toml_key_set_the_port_on_the_host(tmp_path: Path) -> None:
    options = resolved("--grpc-port", "50051", "--host", "0.0.0.0")
    assert (options.settings.grpc_port, options.settings.grpc_host) == (50051, "0.0.0.0")
    path = tmp_path / "serve.toml"
    path.write_text("[server]\ngrpc_port = 0\n")
    assert resolved("--config", str(path)).settings.grpc_port == 0
    assert resolved().settings.grpc_port is None
    with pytest.raises(Exception, match="grpc_port"):
        ServerSettings(grpc_port=True)  # type: ignore[arg-type]


def test_an_invalid_port_or_a_missing_extra_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["serve", "--grpc-port", "70000"]) == 2
    assert "--grpc-port" in capsys.readouterr().err
    monkeypatch.setattr(
        "encdisagg.server._sglang._grpc_server.grpc_missing",
        lambda: "--grpc-port needs the grpc extra (grpc missing): pip install 'encdisagg[grpc]'",
    )
    assert main(["serve", "--grpc-port", "0"]) == 2
    assert "pip install 'encdisagg[grpc]'" in capsys.readouterr().err


@pytest.mark.anyio
async def test_serve_subprocess_over_grpc(anyio_backend_name: str) -> None:
    """``encdisagg serve --grpc-port 0`` on each worker class: it announces the gRPC URL,
    answers Encode with the push and health SERVING, and SIGTERM ends it with exit 0."""
    command = [
        sys.executable, "-m", "encdisagg", "serve", "--port", "0", "--grpc-port", "0",
        "--model", "tiny", "--worker-class", anyio_backend_name, "--log-level", "warning",
    ]  # fmt: skip
    process = await anyio.open_process(command, stdin=subprocess.DEVNULL, stderr=None)
    try:
        assert process.stdout is not None
        lines = BufferedByteReceiveStream(process.stdout)
        with anyio.fail_after(90):
            assert (await lines.receive_until(b"\n", 4096)).startswith(b"encdisagg serving on ")
            line = await lines.receive_until(b"\n", 4096)
        prefix = b"encdisagg gRPC serving on grpc://"
        assert line.startswith(prefix), line
        target = line[len(prefix) :].decode().strip()
        assert not target.endswith(":0")
        assert await health(target) == SERVING
        with pulling() as pull:
            request = pb.EncodeRequest(
                req_id="sub_part_0",
                mm_items=[png_data_url(64, 48, seed=3)],
                num_parts=1,
                prefill_host="127.0.0.1",
                embedding_port=[pull.port],
            )
            await call(target, "Encode", request)
            _, payload = await pull.receive()
        assert payload == await local_bytes(png_bytes(64, 48, seed=3))
        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(60):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await process.aclose()


@pytest.mark.anyio
async def test_an_app_without_the_grpc_extra_fails_its_startup_naming_it(
    make_app: Callable[..., Quart], monkeypatch: pytest.MonkeyPatch
) -> None:
    hint = "--grpc-port needs the grpc extra (grpc missing): pip install 'encdisagg[grpc]'"
    monkeypatch.setattr("encdisagg.server._sglang._grpc_beside.grpc_missing", lambda: hint)
    app = make_app(fast_config(model="null"), grpc_port=0)
    # Quart's test app raises its startup error; QuartTrio's cancels the test with it as the
    # reason. Either carries the message.
    with pytest.raises(BaseException, match=r"needs the grpc extra .*encdisagg\[grpc\]"):
        async with running(app):
            pass
