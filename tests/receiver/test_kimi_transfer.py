"""Kimi-K2.5 embeddings end to end: a real encoder serving tiny-kimi-k25 over HTTP, its parts
over ZMQ and Mooncake TCP, byte-exact against the model run locally."""

from __future__ import annotations

import pytest
import torch

from encdisagg import Modality
from encdisagg.models import KimiVisionModel, load_model
from encdisagg.receiver import EmbeddingReceiver, EncoderClient, fetch_embeddings
from encdisagg.transfer import MooncakeEngine

from .conftest import data_url, encoder_server

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def kimi() -> KimiVisionModel:
    model = load_model("tiny-kimi-k25")
    assert isinstance(model, KimiVisionModel)
    return model


async def test_zmq_and_mooncake_deliver_kimi_embeddings(
    kimi: KimiVisionModel, mooncake_engines: tuple[MooncakeEngine, MooncakeEngine]
) -> None:
    images = [data_url(56, 56, 21), data_url(100, 60, 22), data_url(30, 200, 23)]
    expected = kimi.preprocess(images, Modality.IMAGE)
    reference = torch.cat(kimi.forward([expected]))
    encoder_engine, receiver_engine = mooncake_engines
    receivers = {
        "zmq": EmbeddingReceiver(transport="zmq", hidden_size=kimi.hidden_size, dtype=kimi.dtype),
        "mooncake": EmbeddingReceiver(
            transport="mooncake",
            hidden_size=kimi.hidden_size,
            dtype=kimi.dtype,
            engine=receiver_engine,
            landing_pages=8,
            page_bytes=4096,
        ),
    }
    for transfer, receiver in receivers.items():
        engine = encoder_engine if transfer == "mooncake" else None
        async with (
            encoder_server(kimi, transfer=transfer, engine=engine) as (url, _, _),
            EncoderClient([url]) as client,
            receiver,
            fetch_embeddings(client, receiver, "k", {"image": images}) as embeddings,
        ):
            joined = embeddings.of("image")
            assert joined is not None
            assert joined.grid == expected.grid == ((1, 4, 4), (1, 6, 8), (1, 16, 4))
            assert joined.token_counts == expected.token_counts == (4, 12, 16)
            assert joined.tensor.numpy().tobytes() == reference.numpy().tobytes()
