"""The embedding transport against hostile and careless peers, over real loopback sockets.

- idle ZMQ push sockets to receivers that went away are closed (timer and bound);
- a receiver with default settings refuses a huge frame before buffering it, and a payload
  larger than a part may be, even for an id it awaits;
- with CURVE, a peer without the receiver's key can neither inject a part nor fail a
  pending request, and nothing is ever pushed in the clear.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import zmq
import zmq.utils.monitor
from anyio.streams.buffered import BufferedByteReceiveStream
from PIL import Image

from encdisagg import (
    BadRequestError,
    Encoder,
    EncoderConfig,
    EncodeRequest,
    Modality,
    TransferError,
    ZmqDestination,
)
from encdisagg.models import QwenVisionModel, load_model
from encdisagg.receiver import EmbeddingReceiver, PartMetadata, PartPlan, RequestPlan
from encdisagg.transfer import (
    EmbeddingHeader,
    ZmqPushPool,
    ZmqReceiver,
    encode_header,
    payload_view,
)
from encdisagg.transfer._mooncake._listen import keep_listeners_to_host, socket_inodes

pytestmark = pytest.mark.anyio

HIDDEN = 16


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    """One context for every receiver of a test (a private one each would start a thread)."""
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _header(req_id: str, tokens: int, *, error: str | None = None) -> EmbeddingHeader:
    return EmbeddingHeader(
        req_id=req_id,
        num_parts=1,
        part_idx=0,
        modality="image",
        shape=(0, 0) if error else (tokens, HIDDEN),
        dtype="float16",
        token_counts=() if error else (tokens,),
        grid=() if error else ((1, 1, tokens),),
        error=error,
        status=None if error is None else 400,
    )


def _plan(rid: str) -> RequestPlan:
    part = PartPlan(rid, 0, 1, Modality.IMAGE, "http://encoder", ("item",), 0)
    return RequestPlan(rid, (part,))


def _metadata(rid: str, tokens: int) -> PartMetadata:
    return PartMetadata(
        req_id=f"{rid}#0",
        part_idx=0,
        embedding_size=tokens * HIDDEN * 2,
        embedding_len=tokens,
        embedding_dim=HIDDEN,
        token_counts=(tokens,),
        grid=((1, 1, tokens),),
    )


# -- idle push sockets ---------------------------------------------------------------------


async def test_sixty_receivers_contacted_once_then_gone_leave_no_socket(
    context: zmq.Context[Any],
) -> None:
    async with ZmqPushPool() as pool:
        async with AsyncExitStack() as stack:
            receivers = [
                await stack.enter_async_context(ZmqReceiver(context=context)) for _ in range(60)
            ]
            for index, receiver in enumerate(receivers):
                await pool.send(receiver.url, _header(f"r{index}", 0, error="x"), None)
                with anyio.fail_after(10):
                    await receiver.receive()
        # Every receiver is gone; ZMQ would try to reconnect to each of them forever.
        assert len(pool.endpoints) == 60
        assert pool.close_idle() == 0  # each was used since the last sweep
        assert pool.close_idle() == 60
        assert pool.endpoints == frozenset()


@pytest.mark.virtual_time
async def test_an_idle_socket_closes_on_its_own_while_a_used_one_stays(
    context: zmq.Context[Any],
) -> None:
    async with (
        ZmqPushPool(idle_timeout_s=30, send_timeout_s=3600) as pool,
        ZmqReceiver(context=context) as kept,
    ):
        async with ZmqReceiver(context=context) as gone:
            await pool.send(gone.url, _header("once", 0, error="x"), None)
            with anyio.fail_after(3600):
                await gone.receive()
        for round_ in range(4):
            await anyio.sleep(20)
            await pool.send(kept.url, _header(f"k{round_}", 0, error="x"), None)
            with anyio.fail_after(3600):
                await kept.receive()
        assert pool.endpoints == {kept.url}


async def test_the_pool_keeps_at_most_max_endpoints(context: zmq.Context[Any]) -> None:
    async with ZmqPushPool(max_endpoints=4) as pool, AsyncExitStack() as stack:
        receivers = [
            await stack.enter_async_context(ZmqReceiver(context=context)) for _ in range(6)
        ]
        for index, receiver in enumerate(receivers):
            await pool.send(receiver.url, _header(f"r{index}", 0, error="x"), None)
            with anyio.fail_after(10):
                await receiver.receive()
            assert len(pool.endpoints) <= 4
        assert pool.endpoints == {receiver.url for receiver in receivers[2:]}


async def test_a_socket_in_use_is_never_closed_to_make_room(context: zmq.Context[Any]) -> None:
    nobody = "tcp://127.0.0.1:1"
    async with (
        ZmqPushPool(max_endpoints=1, send_timeout_s=3600) as pool,
        ZmqReceiver(context=context) as receiver,
        anyio.create_task_group() as group,
    ):
        # Waits for a connection that never comes: its socket is in use all along.
        group.start_soon(pool.send, nobody, _header("stuck", 0, error="x"), None)
        await anyio.wait_all_tasks_blocked()
        await pool.send(receiver.url, _header("r", 0, error="x"), None)
        with anyio.fail_after(10):
            await receiver.receive()
        assert pool.endpoints == {nobody, receiver.url}
        assert pool.close_idle() == 0  # both used since the last sweep
        assert pool.close_idle() == 1  # the receiver's; the stuck send keeps its own
        assert pool.endpoints == {nobody}
        group.cancel_scope.cancel()


def test_pool_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="idle_timeout_s"):
        ZmqPushPool(idle_timeout_s=0)
    with pytest.raises(ValueError, match="max_endpoints"):
        ZmqPushPool(max_endpoints=0)
    with pytest.raises(BadRequestError, match="zmq_idle_timeout_s"):
        EncoderConfig(zmq_idle_timeout_s=0)
    with pytest.raises(BadRequestError, match="zmq_max_endpoints"):
        EncoderConfig(zmq_max_endpoints=0)


# -- receiver limits -----------------------------------------------------------------------


def _zmtp_push_announcing(frame_bytes: int) -> bytes:
    """A ZMTP 3.1 PUSH peer's opening (NULL mechanism) and a frame header, no frame body."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
    return greeting + bytes([0x04, len(ready)]) + ready + b"\x02" + struct.pack(">Q", frame_bytes)


async def _peer_is_dropped_after(opening: bytes, url: str) -> bool:
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(opening)
        with anyio.fail_after(10):
            while True:
                try:
                    await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return True


async def test_a_256_mb_frame_is_refused_by_default_before_it_is_buffered() -> None:
    async with EmbeddingReceiver(
        transport="zmq", hidden_size=HIDDEN, dtype=torch.float16
    ) as receiver:
        # The peer announces 256 MB and sends none of it: ZMQ reads the size, refuses it and
        # drops the peer. Had it taken the frame, it would wait for the bytes instead.
        assert await _peer_is_dropped_after(_zmtp_push_announcing(256_000_000), receiver.url)
        async with receiver.expect(_plan("ok")) as pending, ZmqPushPool() as pool:
            pending.note_metadata(_metadata("ok", 4))
            tensor = torch.randn(4, HIDDEN).half()
            await pool.send(receiver.url, _header("ok#0", 4), payload_view(tensor))
            with anyio.fail_after(10):
                result = await pending.wait()
            assert torch.equal(result.parts[0].tensor, tensor)
        assert receiver.stats().malformed_messages == 0


async def test_a_payload_over_max_part_tokens_fails_its_request_not_the_receiver() -> None:
    async with (
        EmbeddingReceiver(
            transport="zmq", hidden_size=HIDDEN, dtype=torch.float16, max_part_tokens=8
        ) as receiver,
        ZmqPushPool() as pool,
    ):
        async with receiver.expect(_plan("big")) as pending:
            oversized = torch.zeros(9, HIDDEN).half()
            await pool.send(receiver.url, _header("big#0", 9), payload_view(oversized))
            with anyio.fail_after(10), pytest.raises(BadRequestError, match="the limit is 256"):
                await pending.wait()
        assert receiver.stats().parts_received == 0
        async with receiver.expect(_plan("fits")) as pending:
            pending.note_metadata(_metadata("fits", 8))
            tensor = torch.randn(8, HIDDEN).half()
            await pool.send(receiver.url, _header("fits#0", 8), payload_view(tensor))
            with anyio.fail_after(10):
                result = await pending.wait()
            assert torch.equal(result.parts[0].tensor, tensor)


async def test_a_receiver_bounds_its_zmq_payloads_by_its_width() -> None:
    receiver = EmbeddingReceiver(
        transport="zmq", hidden_size=HIDDEN, dtype=torch.float16, max_part_tokens=100
    )
    assert receiver._max_payload_bytes == 100 * HIDDEN * 2
    with pytest.raises(BadRequestError, match="max_part_tokens"):
        EmbeddingReceiver(
            transport="zmq", hidden_size=HIDDEN, dtype=torch.float16, max_part_tokens=0
        )


# -- CURVE -------------------------------------------------------------------------------------


def test_pyzmq_has_curve() -> None:
    assert zmq.has("curve")


@asynccontextmanager
async def _curve_receiver(rid: str) -> AsyncIterator[tuple[EmbeddingReceiver, Any, bytes]]:
    public, secret = zmq.curve_keypair()
    async with (
        EmbeddingReceiver(
            transport="zmq", hidden_size=HIDDEN, dtype=torch.float16, curve_secret_key=secret
        ) as receiver,
        receiver.expect(_plan(rid)) as pending,
    ):
        assert receiver.curve_public_key == public
        yield receiver, pending, public


def _wait_for_handshake_failure(monitor: zmq.Socket[Any]) -> int:
    """Block until ``monitor`` reports a failed handshake or a dropped connection."""
    monitor.rcvtimeo = 10_000
    failed = (
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_DISCONNECTED
    )
    while True:
        event = zmq.utils.monitor.recv_monitor_message(monitor)
        if event["event"] & failed:
            return int(event["event"])


def _attacker(
    context: zmq.Context[Any], url: str, server_key: bytes | None
) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """A PUSH socket to ``url`` that queues without a completed connection, and its monitor."""
    sock = context.socket(zmq.PUSH)
    sock.linger = 0
    sock.immediate = False
    if server_key is not None:  # a CURVE client, but with the wrong receiver key
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            server_key,
            public,
            secret,
        )
    monitor = sock.get_monitor_socket()
    sock.connect(url)
    return sock, monitor


async def test_curve_pushes_reach_the_receiver_holding_the_key() -> None:
    async with _curve_receiver("sealed") as (receiver, pending, public):
        pending.note_metadata(_metadata("sealed", 4))
        tensor = torch.randn(4, HIDDEN).half()
        async with ZmqPushPool(curve_server_key=public) as pool:
            await pool.send(receiver.url, _header("sealed#0", 4), payload_view(tensor))
            with anyio.fail_after(10):
                result = await pending.wait()
        assert torch.equal(result.parts[0].tensor, tensor)


@pytest.mark.parametrize("attacker_key", ["none", "wrong"])
async def test_a_peer_without_the_key_cannot_inject_or_fail_a_pending_request(
    attacker_key: str, context: zmq.Context[Any]
) -> None:
    async with _curve_receiver("victim") as (receiver, pending, public):
        wrong_key = zmq.curve_keypair()[0] if attacker_key == "wrong" else None
        sock, monitor = _attacker(context, receiver.url, wrong_key)
        try:
            # Queued on the attacker's side: an error part, then a forged tensor.
            sock.send(encode_header(_header("victim#0", 0, error="forged failure")))
            forged = torch.full((4, HIDDEN), 7.0).half()
            sock.send_multipart([encode_header(_header("victim#0", 4)), forged.numpy()])
            assert await anyio.to_thread.run_sync(_wait_for_handshake_failure, monitor)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        assert pending.error is None
        assert receiver.stats().parts_received == 0
        pending.note_metadata(_metadata("victim", 4))
        tensor = torch.randn(4, HIDDEN).half()
        async with ZmqPushPool(curve_server_key=public) as pool:
            await pool.send(receiver.url, _header("victim#0", 4), payload_view(tensor))
            with anyio.fail_after(10):
                result = await pending.wait()
        assert torch.equal(result.parts[0].tensor, tensor)
        assert receiver.stats().malformed_messages == 0


@pytest.mark.virtual_time
async def test_a_push_with_the_wrong_key_fails_instead_of_reaching_the_receiver() -> None:
    async with _curve_receiver("other") as (receiver, pending, _public):
        async with ZmqPushPool(curve_server_key=zmq.curve_keypair()[0], send_timeout_s=30) as pool:
            with pytest.raises(TransferError, match="timed out"):
                await pool.send(receiver.url, _header("other#0", 0, error="x"), None)
        assert pending.error is None


async def test_with_curve_nothing_is_pushed_in_the_clear(context: zmq.Context[Any]) -> None:
    public, _secret = zmq.curve_keypair()
    async with (
        ZmqReceiver(context=context) as plain,
        ZmqPushPool(curve_server_keys={"tcp://127.0.0.1:1": public}) as pool,
    ):
        with pytest.raises(TransferError, match="no CURVE key"):
            await pool.send(plain.url, _header("r", 0, error="x"), None)
        assert pool.endpoints == frozenset()


@pytest.fixture(scope="module")
def tiny() -> QwenVisionModel:
    return load_model("tiny")


async def test_an_encoder_configured_with_the_key_pushes_through_curve(
    tiny: QwenVisionModel,
) -> None:
    public, secret = zmq.curve_keypair()
    config = EncoderConfig(zmq_curve_server_key=public.decode())
    pil = Image.fromarray(torch.randint(0, 256, (56, 56, 3), dtype=torch.uint8).numpy())
    async with (
        ZmqReceiver(curve_secret_key=secret) as receiver,
        Encoder(config, model=tiny) as encoder,
    ):
        result = await encoder.encode(EncodeRequest("sealed", [pil]))
        await encoder.send("sealed", ZmqDestination(receiver.url))
        with anyio.fail_after(30):
            part = await receiver.receive()
        assert part.header.req_id == "sealed"
        assert part.tensor is not None
        assert part.tensor.shape == (result.num_tokens, result.hidden_size)


def test_curve_keys_are_checked_without_being_shown() -> None:
    secret = "x" * 39
    with pytest.raises(BadRequestError, match="zmq_curve_server_key") as caught:
        EncoderConfig(zmq_curve_server_key=secret)
    assert secret not in str(caught.value)
    with pytest.raises(BadRequestError, match=r"zmq_curve_server_keys\[0\]"):
        EncoderConfig(zmq_curve_server_keys=("tcp://127.0.0.1:5555",))
    public = zmq.curve_keypair()[0].decode()
    config = EncoderConfig(zmq_curve_server_keys=(f"tcp://127.0.0.1:5555 {public}",))
    options = config.zmq_push_options()
    assert options["curve_server_keys"] == {"tcp://127.0.0.1:5555": public.encode()}
    with pytest.raises(BadRequestError, match="curve_secret_key"):
        ZmqReceiver(curve_secret_key=b"short")


# -- Mooncake listens only on its host ---------------------------------------------------------


def _listening_sockets(pid: int) -> list[tuple[str, int]]:
    """The TCP addresses process ``pid`` listens on, as ``ss -ltnp`` would list them."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                address_hex, port_hex = local.split(":")
                # /proc/net/tcp* print each 32-bit word of the address in host order.
                packed = b"".join(
                    struct.pack("<I", int(address_hex[i : i + 8], 16))
                    for i in range(0, len(address_hex), 8)
                )
                found.append((socket.inet_ntop(family, packed), int(port_hex, 16)))
    return found


def _connects(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@pytest.mark.mooncake
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_with_mooncake_answers_only_on_its_loopback_host() -> None:
    command = [
        sys.executable, "-m", "encdisagg", "serve", "--host", "127.0.0.1", "--port", "0",
        "--model", "tiny", "--transfer", "mooncake", "--log-level", "warning",
    ]  # fmt: skip
    process = await anyio.open_process(command, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert process.stdout is not None
        with anyio.fail_after(90):
            line = await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 4096)
        assert line.startswith(b"encdisagg serving on "), line
        listeners = _listening_sockets(process.pid)
        # HTTP, and Mooncake's handshake and TCP data ports.
        assert len(listeners) >= 3, listeners
        for address, port in listeners:
            assert await anyio.to_thread.run_sync(_connects, "127.0.0.1", port, 30.0)
            if address != "127.0.0.1":
                # Mooncake binds every interface; what is not addressed to its host is
                # dropped before a connection exists. 127.0.0.2 reaches any wildcard
                # listener on this machine, so it stands for "another interface".
                assert not await anyio.to_thread.run_sync(_connects, "127.0.0.2", port, 0.5), (
                    address,
                    port,
                )
    finally:
        process.terminate()
        with anyio.move_on_after(30, shield=True):
            await process.wait()
        if process.returncode is None:
            process.kill()
            with anyio.CancelScope(shield=True):
                await process.wait()
        await process.aclose()


@pytest.mark.parametrize(
    ("host", "other"), [("127.0.0.1", "127.0.0.2"), ("::1", "127.0.0.1")], ids=["ipv4", "ipv6"]
)
def test_a_wildcard_listener_is_kept_to_one_host(host: str, other: str) -> None:
    before = socket_inodes()
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as server:
        port = server.getsockname()[1]
        with socket.create_server(("127.0.0.1", 0)) as bystander:
            # Bound to one address already: left alone.
            assert keep_listeners_to_host(host, before, port) == [port]
            assert _connects("127.0.0.1", bystander.getsockname()[1], 30.0)
        assert _connects(host, port, 30.0)
        assert not _connects(other, port, 0.5)
    assert keep_listeners_to_host("0.0.0.0", before, port) == []
