"""SGLang 0.5.20's own language-side code, driving a real ``encdisagg serve --wire sglang``.

Runs under the SGLang venv's python (``nox -s interop`` starts it; ``run.py`` explains the
inputs). Each check uses SGLang's classes as far up the receiver stack as runs on CPU:

- ``zmq_to_tokenizer``: ``MMReceiverHTTP.recv_mm_data``, the tokenizer's whole flow: its
  ``/encode`` bodies (items split over two encoder URLs, so two parts), its PULL socket,
  ``safe_pickle_loads`` and the ``MultiModalEmbeddingData`` assembly of our frames;
- ``zmq_to_scheduler``: two TP ranks as ``WaitingZmqRequest`` (their ``/scheduler_receive_url``
  registrations on SGLang's registration runner, their receive loop ``_try_recv_mm_data``),
  with the tokenizer's ``/encode`` bodies from ``MMReceiverHTTP.encode``;
- ``mooncake``: two TP ranks as ``WaitingRDMARequest`` (``/scheduler_receive_meta_data``, the
  buffer, ``/send``, then the completion notice on their PULL socket), with SGLang's own
  ``MooncakeTransferEngine`` over TCP.

What does not run on CPU is replaced by stand-ins, named ``Cpu*``/``Recording*`` below: the
model's multimodal processor (``get_validated_mm_data`` records what it was given) and the
GPU ``EmbeddingPool`` (a registered CPU buffer). Every check compares the assembled tensors
with a local encode, byte for byte, and sends a bad item to see the waiting request fail.

Checks are rows of :data:`CHECKS` (mode, transport, function); the gRPC transport adds its
rows there. Output: one JSON object per row on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_shims = os.environ.get("ENCDISAGG_PEER_SHIMS")
if _shims:
    # The peer venv's CPU workaround for torchvision (see ../shared/peer/README.md).
    sys.path.insert(0, _shims)
    import tv_cpu_shim  # noqa: F401

import torch  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402
from sglang.srt.disaggregation.encoder import receiver as sglang_receiver  # noqa: E402
from sglang.srt.managers.schedule_batch import Modality  # noqa: E402

#: Bounds of one check (SGLang's own default receive timeout is 180 s).
RECV_TIMEOUT_S = 60.0
BAD_ITEM = "data:image/png;base64,AAAA"


@dataclass
class Inputs:
    """What ``run.py`` hands over: two images and their local encodes."""

    images: list[str]
    reference: list[bytes]
    grids: list[list[int]]
    dtype: torch.dtype
    hidden: int


class RecordedInputs:
    """What the processor stand-in returns (SGLang binds the pool slot's lifetime to it)."""

    def __init__(self) -> None:
        self.input_ids = [1, 2, 3]
        self.mm_items: list[Any] = []


class RecordingProcessor:
    """Stands in for the model's multimodal processor (it needs the model's tokenizer and
    config): records the embeddings and grid SGLang assembled for it."""

    prefer_tokenized_input = False

    def __init__(self) -> None:
        self.calls: list[tuple[dict[Any, torch.Tensor], dict[str, Any]]] = []

    def get_validated_mm_data(self, prompt: Any, embeddings: Any, **meta: Any) -> Any:
        self.calls.append(({k: v.clone() for k, v in embeddings.items()}, meta))
        return RecordedInputs()


class CpuEmbeddingPool:
    """Stands in for SGLang's GPU ``EmbeddingPool``: one CPU buffer, registered once."""

    def __init__(self, engine: Any, nbytes: int) -> None:
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.engine = engine
        engine.register(self.buffer.data_ptr(), nbytes)
        self.allocated: list[int] = []
        self.released: list[int] = []

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, int, int] | None:
        if nbytes > self.buffer.numel():
            return None
        self.allocated.append(nbytes)
        return self.buffer[:nbytes], self.buffer.data_ptr(), len(self.allocated)

    def release_on_gc(self, obj: Any, slot_id: int) -> weakref.finalize:
        return weakref.finalize(obj, self.release, slot_id)

    def release(self, slot_id: int) -> None:
        self.released.append(slot_id)

    def close(self) -> None:
        self.engine.deregister(self.buffer.data_ptr())


def _recv_req(rid: str, parts: int) -> Any:
    return SimpleNamespace(
        rid=rid,
        num_items_assigned={Modality.IMAGE: [1] * parts},
        input_ids=[1, 2, 3],
        input_text="<image>" * parts,
        mm_inputs=None,
    )


def _tokenizer(urls: list[str]) -> Any:
    """SGLang's tokenizer-side receiver, without the parts of its constructor that load a
    model (server args, processor): only the attributes its encode/receive path reads."""
    receiver = object.__new__(sglang_receiver.MMReceiverHTTP)
    receiver.encode_urls = list(urls)
    receiver.host = "127.0.0.1"
    receiver.context = zmq.asyncio.Context()
    receiver.recv_timeout = RECV_TIMEOUT_S
    receiver.model_type = None
    return receiver


def _mm_data(images: list[str]) -> list[dict[str, Any]]:
    return [{"modality": Modality.IMAGE, "url": image} for image in images]


def _check_assembled(processor: RecordingProcessor, inputs: Inputs) -> None:
    assert len(processor.calls) == 1, f"the processor was called {len(processor.calls)} times"
    embeddings, meta = processor.calls[0]
    image = embeddings[Modality.IMAGE]
    assert image.dtype == inputs.dtype, f"dtype {image.dtype}"
    expected = b"".join(inputs.reference)
    assert image.contiguous().numpy().tobytes() == expected, "assembled bytes differ"
    grid = meta["img_grid_thw"]
    assert grid.tolist() == inputs.grids, f"img_grid_thw {grid.tolist()}"


# --- zmq_to_tokenizer ----------------------------------------------------------------------


async def _receive_then_fail(receiver: Any, inputs: Inputs) -> float:
    """The tokenizer receives both images byte-equal, then a request with a bad item fails
    at once (not at its receive timeout); how long that failure took, in seconds."""
    processor = RecordingProcessor()
    request = SimpleNamespace()
    receiver._extract_url_data = lambda _request: _mm_data(inputs.images)
    result = await receiver.recv_mm_data(request, processor, "<image><image>")
    assert result is not None, "recv_mm_data gave up"
    _check_assembled(processor, inputs)
    receiver._extract_url_data = lambda _request: _mm_data([inputs.images[0], BAD_ITEM])
    failing = RecordingProcessor()
    started = time.monotonic()
    result = await receiver.recv_mm_data(request, failing, "<image><image>")
    waited = time.monotonic() - started
    assert result is None, "a bad item did not fail the request"
    assert not failing.calls, "a failed request reached the processor"
    assert waited < RECV_TIMEOUT_S / 2, f"the failure took {waited:.1f} s"
    return waited


async def zmq_to_tokenizer(url: str, inputs: Inputs) -> str:
    waited = await _receive_then_fail(_tokenizer([url, url]), inputs)
    return f"2 parts byte-equal; error part failed the request in {waited:.2f} s"


# --- zmq_to_scheduler ----------------------------------------------------------------------


def _poll(ranks: list[Any], deadline_s: float) -> None:
    """Run each rank's receive step, as the scheduler loop does, until none is pending."""
    end = time.monotonic() + deadline_s
    while any(rank.status == sglang_receiver.WaitingMMRequestStatus.PENDING for rank in ranks):
        assert time.monotonic() < end, "ranks still pending at the deadline"
        for rank in ranks:
            rank._try_recv_mm_data()
        time.sleep(0.005)


async def zmq_to_scheduler(url: str, inputs: Inputs) -> str:
    outcomes = []
    for images, should_fail in ((inputs.images, False), ([inputs.images[0], BAD_ITEM], True)):
        rid = uuid.uuid4().hex
        runner = sglang_receiver._ReceiveRegistrationRunner("registration")
        processors = [RecordingProcessor() for _ in range(2)]
        ranks = [
            sglang_receiver.WaitingZmqRequest(
                rid=rid,
                recv_req=_recv_req(rid, 2),
                mm_processor=processor,
                encoder_urls=[url, url],
                model_type=None,
                host_name="127.0.0.1",
                receive_count=2,
                registration_runner=runner,
            )
            for processor in processors
        ]
        # The tokenizer's /encode (embedding_port null) and each rank's registration.
        tokenizer = _tokenizer([url, url])
        dispatch = asyncio.ensure_future(
            tokenizer.encode(
                rid,
                _mm_data(images),
                None,
                "encode",
                num_items_assigned={Modality.IMAGE: [1, 1]},
            )
        )
        for rank in ranks:
            rank.send_encode_request()
        await asyncio.to_thread(_poll, ranks, RECV_TIMEOUT_S)
        dispatched = await dispatch
        statuses = [rank.status for rank in ranks]
        if should_fail:
            assert all(s == sglang_receiver.WaitingMMRequestStatus.FAIL for s in statuses)
            codes = {rank.error_code for rank in ranks}
            assert codes == {400}, f"error codes {codes}"
            assert dispatched is not None, "the failed /encode was not reported"
            outcomes.append(
                f"error part failed both ranks (error_code 400: {ranks[0].error_msg!r})"
            )
        else:
            assert all(s == sglang_receiver.WaitingMMRequestStatus.SUCCESS for s in statuses)
            for processor in processors:
                _check_assembled(processor, inputs)
            assert dispatched is None
            outcomes.append("2 ranks x 2 parts byte-equal")
        runner.loop.call_soon_threadsafe(runner.loop.stop)
    return "; ".join(outcomes)


# --- mooncake -------------------------------------------------------------------------------


async def mooncake(url: str, inputs: Inputs) -> str:
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    engines = [MooncakeTransferEngine("127.0.0.1") for _ in range(2)]
    total = sum(len(part) for part in inputs.reference)
    pools = [CpuEmbeddingPool(engine, total) for engine in engines]
    outcomes = []
    try:
        for images, should_fail in ((inputs.images, False), ([inputs.images[0], BAD_ITEM], True)):
            rid = uuid.uuid4().hex
            processors = [RecordingProcessor() for _ in range(2)]
            ranks = [
                sglang_receiver.WaitingRDMARequest(
                    rid=rid,
                    recv_req=_recv_req(rid, 2),
                    mm_processor=processor,
                    encoder_urls=[url, url],
                    host_name="127.0.0.1",
                    receive_count=2,
                    zmq_context=zmq.Context(),
                    embeddings_engine=engine,
                    dtype=inputs.dtype,
                    embedding_pool=pool,
                )
                for processor, engine, pool in zip(processors, engines, pools, strict=True)
            ]
            for pool in pools:
                pool.buffer.zero_()
            tokenizer = _tokenizer([url, url])
            dispatched = await tokenizer.encode(
                rid, _mm_data(images), None, "encode", num_items_assigned={Modality.IMAGE: [1, 1]}
            )
            for rank in ranks:
                rank.send_encode_request()
            await asyncio.to_thread(_poll, ranks, RECV_TIMEOUT_S)
            statuses = [rank.status for rank in ranks]
            if should_fail:
                assert dispatched is not None, "the failed /encode was not reported"
                assert all(s == sglang_receiver.WaitingMMRequestStatus.FAIL for s in statuses)
                outcomes.append(
                    f"error failed both ranks ({ranks[0].error_code}: {ranks[0].error_msg!r})"
                )
            else:
                assert dispatched is None, f"/encode failed: {dispatched}"
                assert all(s == sglang_receiver.WaitingMMRequestStatus.SUCCESS for s in statuses)
                for processor in processors:
                    _check_assembled(processor, inputs)
                outcomes.append(
                    "2 ranks x 2 parts landed byte-equal over Mooncake TCP, notices read"
                )
    finally:
        for pool in pools:
            pool.close()
    return "; ".join(outcomes)


#: (mode, transport, check). A check gets the server's URL and the inputs and returns a
#: one-line outcome, or raises. The gRPC transport appends its rows here.
CHECKS: list[tuple[str, str, Callable[[str, Inputs], Awaitable[str]]]] = [
    ("zmq_to_tokenizer", "http", zmq_to_tokenizer),
    ("zmq_to_scheduler", "http", zmq_to_scheduler),
    ("mooncake", "http", mooncake),
]


# --- gRPC: the SglangEncoder service of ``serve --grpc-port`` -------------------------------
#
# SGLang 0.5.20's gRPC language side (``SGLANG_ENCODER_MM_RECEIVER_MODE=grpc``, ``grpc://``
# encoder URLs): ``MMReceiverGrpc.encode`` (its EncodeRequests, sent by its own
# ``_grpc_encode_request`` over blocking stubs in threads) and ``WaitingZmqRequestGrpc`` (its
# ranks' ``SchedulerReceiveUrl`` over ``_grpc_scheduler_receive_url``). The stub is
# smg-grpc-proto's ``SglangEncoderStub``, which SGLang imports; run.py puts grpcio and
# smg-grpc-proto beside the venv (SGLang's venv is built without its dependencies).
# SGLang's gRPC receiver refuses ``mooncake``; the mooncake row drives the Send RPC with the
# stub itself, into a buffer registered with SGLang's own MooncakeTransferEngine.
#
# One encoder URL per check, so both images travel as one part: SGLang's gRPC client names
# every part of a request by the request's own id (its HTTP client adds ``_local_part_K``),
# so two parts on one encoder would collide (``is live already``), with SGLang's own encoder
# as with ours. Deployments give each part its own encoder.


def _grpc_tokenizer(urls: list[str]) -> Any:
    """SGLang's gRPC tokenizer-side receiver, built as :func:`_tokenizer` builds HTTP's."""
    receiver = object.__new__(sglang_receiver.MMReceiverGrpc)
    receiver.encode_urls = list(urls)
    receiver.host = "127.0.0.1"
    receiver.context = zmq.asyncio.Context()
    receiver.recv_timeout = RECV_TIMEOUT_S
    receiver.model_type = None
    return receiver


async def grpc_zmq_to_tokenizer(url: str, inputs: Inputs) -> str:
    import grpc

    waited = await _receive_then_fail(_grpc_tokenizer([url]), inputs)
    # What SGLang's client saw for the bad part: the status its own encoder answers.
    bad = {
        "mm_items": [BAD_ITEM],
        "req_id": uuid.uuid4().hex,
        "num_parts": 1,
        "part_idx": 0,
        "prefill_host": "127.0.0.1",
        "embedding_port": None,
    }
    try:
        await asyncio.to_thread(
            sglang_receiver._grpc_encode_request, sglang_receiver._grpc_target(url), bad
        )
    except grpc.RpcError as exc:
        code = exc.code()
    else:
        raise AssertionError("a bad item was answered OK")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"bad item answered {code}"
    return (
        f"1 part of 2 images byte-equal; error part failed the request in {waited:.2f} s "
        f"(the RPC: {code.name})"
    )


async def grpc_zmq_to_scheduler(url: str, inputs: Inputs) -> str:
    import grpc

    outcomes = []
    for images, should_fail in ((inputs.images, False), ([inputs.images[0], BAD_ITEM], True)):
        rid = uuid.uuid4().hex
        runner = sglang_receiver._ReceiveRegistrationRunner("registration")
        processors = [RecordingProcessor() for _ in range(2)]
        recv_req = _recv_req(rid, 1)
        recv_req.num_items_assigned = {Modality.IMAGE: [len(images)]}
        ranks = [
            sglang_receiver.WaitingZmqRequestGrpc(
                rid=rid,
                recv_req=recv_req,
                mm_processor=processor,
                encoder_urls=[url],
                model_type=None,
                host_name="127.0.0.1",
                receive_count=2,
                registration_runner=runner,
            )
            for processor in processors
        ]
        tokenizer = _grpc_tokenizer([url])
        dispatch = asyncio.ensure_future(
            tokenizer.encode(
                rid,
                _mm_data(images),
                None,
                "encode",
                num_items_assigned={Modality.IMAGE: [len(images)]},
            )
        )
        for rank in ranks:
            rank.send_encode_request()
        await asyncio.to_thread(_poll, ranks, RECV_TIMEOUT_S)
        try:
            await dispatch
            dispatch_error = None
        except grpc.RpcError as exc:
            dispatch_error = exc.code()
        statuses = [rank.status for rank in ranks]
        if should_fail:
            assert all(s == sglang_receiver.WaitingMMRequestStatus.FAIL for s in statuses)
            codes = {rank.error_code for rank in ranks}
            assert codes == {400}, f"error codes {codes}"
            assert dispatch_error == grpc.StatusCode.INVALID_ARGUMENT, dispatch_error
            outcomes.append(
                f"error part failed both ranks (error_code 400: {ranks[0].error_msg!r}; "
                f"the RPC: {dispatch_error.name})"
            )
        else:
            assert all(s == sglang_receiver.WaitingMMRequestStatus.SUCCESS for s in statuses)
            for processor in processors:
                _check_assembled(processor, inputs)
            assert dispatch_error is None, dispatch_error
            outcomes.append("2 ranks x 1 part of 2 images byte-equal (registered over gRPC)")
        runner.loop.call_soon_threadsafe(runner.loop.stop)
    return "; ".join(outcomes)


async def grpc_mooncake(url: str, inputs: Inputs) -> str:
    """SGLang's gRPC receiver refuses mooncake, so the stub drives Encode and Send itself;
    the rank side is SGLang's: its MooncakeTransferEngine, ``safe_pickle_loads`` of the
    completion notice, the EmbeddingData it describes."""
    import grpc
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )
    from sglang.srt.utils.common import safe_pickle_loads
    from smg_grpc_proto import sglang_encoder_pb2 as pb, sglang_encoder_pb2_grpc as pb_grpc

    target = sglang_receiver._grpc_target(url)
    engine = MooncakeTransferEngine("127.0.0.1")
    expected = inputs.reference[0]
    buffer = torch.zeros(len(expected), dtype=torch.uint8)
    engine.register(buffer.data_ptr(), len(expected))
    context = zmq.Context()
    notices = context.socket(zmq.PULL)
    port = notices.bind_to_random_port("tcp://127.0.0.1")

    def calls() -> tuple[Any, bytes, grpc.StatusCode]:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.SglangEncoderStub(channel)
            part = f"{uuid.uuid4().hex}_local_part_0"
            sizes = stub.Encode(
                pb.EncodeRequest(mm_items=[inputs.images[0]], req_id=part, num_parts=1, part_idx=0),
                timeout=RECV_TIMEOUT_S,
            )
            send = pb.SendRequest(
                req_id=part,
                prefill_host="127.0.0.1",
                embedding_port=port,
                session_id=engine.get_session_id(),
                buffer_address=buffer.data_ptr(),
            )
            stub.Send(send, timeout=RECV_TIMEOUT_S)
            assert notices.poll(int(RECV_TIMEOUT_S * 1000)), "no completion notice"
            notice = notices.recv_multipart()
            assert len(notice) == 1, f"the notice has {len(notice)} frames"
            try:
                stub.Send(send, timeout=RECV_TIMEOUT_S)
            except grpc.RpcError as exc:
                again = exc.code()
            else:
                raise AssertionError("a second Send of a released part was answered OK")
            return sizes, notice[0], again

    try:
        sizes, notice, again = await asyncio.to_thread(calls)
        assert sizes.embedding_size == len(expected), f"embedding_size {sizes.embedding_size}"
        assert sizes.embedding_dim == inputs.hidden, f"embedding_dim {sizes.embedding_dim}"
        data = safe_pickle_loads(notice)
        assert isinstance(data, sglang_receiver.EmbeddingData), type(data).__name__
        assert data.error_msg is None, data.error_msg
        assert list(data.shape) == [sizes.embedding_len, sizes.embedding_dim], data.shape
        assert buffer.numpy().tobytes() == expected, "the Mooncake write differs"
        assert again == grpc.StatusCode.INTERNAL, again
    finally:
        notices.close(linger=0)
        context.term()
        engine.deregister(buffer.data_ptr())
    return (
        "Encode sizes, Send wrote byte-equal over Mooncake TCP, notice read by "
        f"safe_pickle_loads; a released part's Send: {again.name} (SGLang's gRPC receiver "
        "itself refuses mooncake)"
    )


CHECKS += [
    ("zmq_to_tokenizer", "grpc", grpc_zmq_to_tokenizer),
    ("zmq_to_scheduler", "grpc", grpc_zmq_to_scheduler),
    ("mooncake", "grpc", grpc_mooncake),
]


def _inputs(folder: Path) -> Inputs:
    meta = json.loads((folder / "inputs.json").read_text())
    return Inputs(
        images=meta["images"],
        reference=[(folder / name).read_bytes() for name in meta["reference_files"]],
        grids=meta["grids"],
        dtype=getattr(torch, meta["dtype"]),
        hidden=meta["hidden"],
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=Path, required=True, help="folder written by run.py")
    parser.add_argument(
        "--servers",
        required=True,
        help='JSON: {"<transfer>": {"<worker class>": {"<transport>": URL}}}',
    )
    args = parser.parse_args()
    inputs = _inputs(args.inputs)
    servers: dict[str, dict[str, dict[str, str]]] = json.loads(args.servers)
    failed = 0
    classes = list(dict.fromkeys(name for by_class in servers.values() for name in by_class))
    for worker_class in classes:
        for mode, transport, check in CHECKS:
            transfer = "mooncake" if mode == "mooncake" else "zmq"
            url = servers.get(transfer, {}).get(worker_class, {}).get(transport)
            row = {"mode": mode, "worker_class": worker_class, "transport": transport}
            if url is None:
                row.update(outcome="skipped", detail="no server for this row")
            else:
                try:
                    detail = await asyncio.wait_for(check(url, inputs), 2 * RECV_TIMEOUT_S)
                    row.update(outcome="pass", detail=detail)
                except Exception as exc:
                    failed += 1
                    row.update(outcome="FAIL", detail=f"{type(exc).__name__}: {exc}")
                    traceback.print_exc(file=sys.stderr)
            print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = asyncio.run(main())
    # SGLang's registration runners and receive threads are daemons; leave without them.
    sys.stdout.flush()
    os._exit(code)
