"""Qwen3-VL embeddings (main + deepstack sections) end to end: real encoders, real ZMQ and
Mooncake TCP transfers, the prefix cache, and the receiver's section views."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest
import torch

from encdisagg import (
    BadRequestError,
    Encoder,
    EncoderConfig,
    EncodeRequest,
    Modality,
    ZmqDestination,
)
from encdisagg.models import Qwen3VisionModel, load_model
from encdisagg.receiver import EmbeddingReceiver, EncoderClient, fetch_embeddings
from encdisagg.transfer import MooncakeEngine, ZmqReceiver, deepstack_layout

from .conftest import data_url, encoder_server

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def qwen3() -> Qwen3VisionModel:
    model = load_model("tiny-qwen3-vl")
    assert isinstance(model, Qwen3VisionModel)
    return model


@pytest.fixture(scope="module")
def images() -> list[str]:
    return [data_url(56, 56, 11), data_url(100, 70, 12)]


def reference(model: Qwen3VisionModel, items: list[Any]) -> torch.Tensor:
    return torch.cat(model.forward([model.preprocess(items, Modality.IMAGE)]))


def receiver_for(model: Qwen3VisionModel, **options: Any) -> EmbeddingReceiver:
    return EmbeddingReceiver(
        hidden_size=model.hidden_size,
        dtype=model.dtype,
        layout=model.embedding_layout,
        **options,
    )


def assert_sections(model: Qwen3VisionModel, joined: Any, expected: torch.Tensor) -> None:
    # Byte-exact, and each section a view of the received tensor (no copy).
    assert joined.tensor.numpy().tobytes() == expected.numpy().tobytes()
    assert joined.layout == model.embedding_layout
    width = model.token_width
    assert torch.equal(joined.main, expected[:, :width])
    assert len(joined.deepstack) == model.deepstack_layers == 2
    for index, section in enumerate(joined.deepstack):
        assert torch.equal(section, expected[:, width * (index + 1) : width * (index + 2)])
    storage = joined.tensor.untyped_storage().data_ptr()
    for view in joined.sections().values():
        assert view.untyped_storage().data_ptr() == storage


async def test_deepstack_arrives_byte_exact_over_zmq(
    qwen3: Qwen3VisionModel, images: list[str]
) -> None:
    receiver = receiver_for(qwen3, transport="zmq")
    async with (
        encoder_server(qwen3) as (url, _, _),
        EncoderClient([url]) as client,
        receiver,
        fetch_embeddings(client, receiver, "r", {"image": images}) as embeddings,
    ):
        joined = embeddings.of("image")
        assert joined is not None
        assert joined.token_counts == qwen3.preprocess(images, Modality.IMAGE).token_counts
        assert_sections(qwen3, joined, reference(qwen3, images))


async def test_deepstack_arrives_byte_exact_over_mooncake_tcp(
    qwen3: Qwen3VisionModel,
    images: list[str],
    mooncake_engines: tuple[MooncakeEngine, MooncakeEngine],
) -> None:
    encoder_engine, receiver_engine = mooncake_engines
    receiver = receiver_for(
        qwen3, transport="mooncake", engine=receiver_engine, landing_pages=32, page_bytes=8192
    )
    async with (
        encoder_server(qwen3, transfer="mooncake", engine=encoder_engine) as (url, _, _),
        EncoderClient([url]) as client,
        receiver,
        fetch_embeddings(client, receiver, "r", {"image": images}) as embeddings,
    ):
        joined = embeddings.of("image")
        assert joined is not None
        base = receiver.pool.ptr
        assert base <= joined.tensor.data_ptr() < base + receiver.pool.nbytes
        assert_sections(qwen3, joined, reference(qwen3, images))


async def test_the_push_header_names_the_layout(qwen3: Qwen3VisionModel, images: list[str]) -> None:
    config = EncoderConfig(request_timeout_s=30.0, send_timeout_s=30.0)
    async with ZmqReceiver() as pull, Encoder(config, model=qwen3) as encoder:
        result = await encoder.encode(EncodeRequest("r", images))
        assert result.hidden_size == 192
        await encoder.send("r", ZmqDestination(pull.url))
        with anyio.fail_after(30):
            part = await pull.receive()
    assert part.header.layout == qwen3.embedding_layout
    assert part.header.shape == (result.num_tokens, 192)
    assert part.tensor is not None
    assert part.tensor.numpy().tobytes() == reference(qwen3, images).numpy().tobytes()


async def test_a_receiver_expecting_another_layout_refuses_the_part(
    qwen3: Qwen3VisionModel, images: list[str]
) -> None:
    # Same width (192 columns), other sections: only the header's layout tells them apart.
    receiver = EmbeddingReceiver(
        transport="zmq",
        hidden_size=192,
        dtype=qwen3.dtype,
        layout=deepstack_layout(96, 1),
    )
    async with (
        encoder_server(qwen3) as (url, _, _),
        EncoderClient([url]) as client,
        receiver,
    ):
        with pytest.raises(BadRequestError, match="layout is"):
            async with fetch_embeddings(client, receiver, "r", {"image": images[:1]}):
                pytest.fail("no embeddings expected")


def test_a_layout_must_fit_the_receivers_width(qwen3: Qwen3VisionModel) -> None:
    with pytest.raises(BadRequestError, match="layout has 192 columns, but hidden_size is 64"):
        EmbeddingReceiver(
            transport="zmq", hidden_size=64, dtype=qwen3.dtype, layout=qwen3.embedding_layout
        )


async def test_a_prefix_cache_hit_returns_the_same_bytes(
    qwen3: Qwen3VisionModel, images: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forwards: list[int] = []
    forward: Callable[..., list[torch.Tensor]] = qwen3.forward

    def counted(batch: Any) -> list[torch.Tensor]:
        forwards.append(len(batch))
        return forward(batch)

    monkeypatch.setattr(qwen3, "forward", counted)
    config = EncoderConfig(prefix_cache_mb=8, request_timeout_s=30.0, send_timeout_s=30.0)
    received: list[bytes] = []
    async with ZmqReceiver() as pull, Encoder(config, model=qwen3) as encoder:
        for rid in ("first", "again"):
            await encoder.encode(EncodeRequest(rid, images))
            await encoder.send(rid, ZmqDestination(pull.url))
            with anyio.fail_after(30):
                part = await pull.receive()
            assert part.tensor is not None
            assert part.header.layout == qwen3.embedding_layout
            received.append(part.tensor.numpy().tobytes())
        assert encoder.stats().cache_entries >= 1
    assert len(forwards) == 1  # the second request never reached the tower
    assert received[0] == received[1]
    monkeypatch.undo()
    assert received[1] == reference(qwen3, images).numpy().tobytes()


async def test_the_encode_answer_reports_the_joint_width(
    qwen3: Qwen3VisionModel, images: list[str]
) -> None:
    async with encoder_server(qwen3) as (url, _, _), httpx.AsyncClient() as http:
        body = {"req_id": "w", "mm_items": images[:1], "modality": "image"}
        answer = (await http.post(f"{url}/encode", json=body)).json()
        await http.post(f"{url}/release", json={"req_id": "w"})
    assert answer["embedding_dim"] == 192
    assert answer["embedding_size"] == answer["embedding_len"] * 192 * 4
