"""Audio embeddings end to end: the tiny audio encoders behind real HTTP, real ZMQ and
Mooncake TCP transfers, the prefix cache."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest
import torch

from encdisagg import Encoder, EncoderConfig, EncodeRequest, Modality, ZmqDestination
from encdisagg.models import QwenAudioModel, load_model
from encdisagg.receiver import EmbeddingReceiver, EncoderClient, fetch_embeddings
from encdisagg.transfer import MooncakeEngine, ZmqReceiver

from ..models._audio_samples import clip
from .conftest import encoder_server

pytest.importorskip("soundfile")
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", params=["tiny-qwen2-audio", "tiny-qwen2.5-omni-audio"])
def audio_model(request: pytest.FixtureRequest) -> QwenAudioModel:
    model = load_model(request.param)
    assert isinstance(model, QwenAudioModel)
    return model


@pytest.fixture(scope="module")
def clips() -> list[object]:
    # As clients send them: a data URL of a WAV, and FLAC bytes behind a content hash.
    wav = "data:audio/wav;base64," + base64.b64encode(clip(1.3)).decode()
    flac = base64.b64encode(clip(2.2, 44_100, "flac", channels=2)).decode()
    return [wav, {"url": flac}]


def reference(model: QwenAudioModel, items: list[Any]) -> bytes:
    rows = torch.cat(model.forward([model.preprocess(items, Modality.AUDIO)]))
    return rows.numpy().tobytes()


def receiver_for(model: QwenAudioModel, **options: Any) -> EmbeddingReceiver:
    return EmbeddingReceiver(hidden_size=model.hidden_size, dtype=model.dtype, **options)


async def test_audio_arrives_byte_exact_over_zmq(
    audio_model: QwenAudioModel, clips: list[object]
) -> None:
    receiver = receiver_for(audio_model, transport="zmq")
    async with (
        encoder_server(audio_model) as (url, _, _),
        EncoderClient([url]) as client,
        receiver,
        fetch_embeddings(client, receiver, "a", {"audio": clips}) as embeddings,
    ):
        joined = embeddings.of("audio")
        assert joined is not None
        assert joined.token_counts == (32, 55)
        assert joined.tensor.numpy().tobytes() == reference(audio_model, clips)


async def test_audio_arrives_byte_exact_over_mooncake_tcp(
    audio_model: QwenAudioModel,
    clips: list[object],
    mooncake_engines: tuple[MooncakeEngine, MooncakeEngine],
) -> None:
    encoder_engine, receiver_engine = mooncake_engines
    receiver = receiver_for(
        audio_model,
        transport="mooncake",
        engine=receiver_engine,
        landing_pages=32,
        page_bytes=8192,
    )
    async with (
        encoder_server(audio_model, transfer="mooncake", engine=encoder_engine) as (url, _, _),
        EncoderClient([url]) as client,
        receiver,
        fetch_embeddings(client, receiver, "a", {"audio": clips}) as embeddings,
    ):
        joined = embeddings.of("audio")
        assert joined is not None
        base = receiver.pool.ptr
        assert base <= joined.tensor.data_ptr() < base + receiver.pool.nbytes
        assert joined.tensor.numpy().tobytes() == reference(audio_model, clips)


async def test_a_prefix_cache_hit_returns_the_same_bytes(
    audio_model: QwenAudioModel, clips: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    forwards: list[int] = []
    forward: Callable[..., list[torch.Tensor]] = audio_model.forward

    def counted(batch: Any) -> list[torch.Tensor]:
        forwards.append(len(batch))
        return forward(batch)

    monkeypatch.setattr(audio_model, "forward", counted)
    config = EncoderConfig(prefix_cache_mb=8, request_timeout_s=30.0, send_timeout_s=30.0)
    received: list[bytes] = []
    async with ZmqReceiver() as pull, Encoder(config, model=audio_model) as encoder:
        for rid in ("first", "again"):
            result = await encoder.encode(EncodeRequest(rid, clips, modality="audio"))
            assert result.grid == ((130,), (220,))
            await encoder.send(rid, ZmqDestination(pull.url))
            with anyio.fail_after(30):
                part = await pull.receive()
            assert part.tensor is not None
            assert part.header.modality == "audio"
            assert part.header.grid == ((130,), (220,))
            received.append(part.tensor.numpy().tobytes())
        assert encoder.stats().cache_entries >= 1
    assert len(forwards) == 1  # the second request never reached the encoder
    assert received[0] == received[1]
    monkeypatch.undo()
    assert received[1] == reference(audio_model, clips)


async def test_the_encode_answer_and_a_refusal_over_http(
    audio_model: QwenAudioModel, clips: list[object]
) -> None:
    async with encoder_server(audio_model) as (url, _, _), httpx.AsyncClient() as http:
        body = {"req_id": "w", "mm_items": clips[:1], "modality": "audio"}
        answer = (await http.post(f"{url}/encode", json=body)).json()
        await http.post(f"{url}/release", json={"req_id": "w"})
        image = {"req_id": "i", "mm_items": clips[:1], "modality": "image"}
        refused = await http.post(f"{url}/encode", json=image)
    assert answer["token_counts"] == [32]
    assert answer["grid"] == [[130]]
    assert answer["embedding_dim"] == 64
    assert refused.status_code == 400
    assert "not supported" in refused.json()["message"]
