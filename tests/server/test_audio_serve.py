"""``encdisagg serve --model tiny-qwen2-audio`` (and the Qwen2.5-Omni twin): audio through
the real server process, its health probe, and hostile audio refused naming the limit.

Two servers, shared by the module: Qwen2-Audio under the asyncio worker, Qwen2.5-Omni
under Trio.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from ..models._audio_samples import clip, encode

pytest.importorskip("soundfile")

CONFIG = """
[encoder]
max_audio_seconds = 10.0
max_audio_sample_rate = 48000
"""


@dataclass
class Served:
    model: str
    client: httpx.Client

    def encode(self, req_id: str, items: list[object], modality: str = "audio") -> httpx.Response:
        body = {"req_id": req_id, "mm_items": items, "modality": modality}
        response = self.client.post("/encode", json=body)
        self.client.post("/release", json={"req_id": req_id})
        return response


@pytest.fixture(
    scope="module",
    params=[("tiny-qwen2-audio", "asyncio"), ("tiny-qwen2.5-omni-audio", "trio")],
    ids=["qwen2-audio-asyncio", "qwen2.5-omni-trio"],
)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    model, worker = request.param
    config = tmp_path_factory.mktemp("audio") / "encoder.toml"
    config.write_text(CONFIG)
    command = [
        sys.executable, "-m", "encdisagg", "serve", "--port", "0", "--model", model,
        "--config", str(config), "--worker-class", worker, "--log-level", "error",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the first line says where it serves
        assert " on http" in line, line
        url = line.rsplit(" on ", 1)[1].strip()
        with httpx.Client(base_url=url, timeout=120) as client:
            yield Served(model, client)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def data_url(data: bytes, kind: str) -> str:
    return f"data:audio/{kind};base64," + base64.b64encode(data).decode()


def test_health_probes_with_audio(served: Served) -> None:
    response = served.client.get("/health")
    assert response.status_code == 200, response.text
    assert response.json()["probed"] is True


def test_encode_answers_audio_token_counts(served: Served) -> None:
    items = [data_url(clip(3.0), "wav"), data_url(clip(1.0, 44_100, "flac", channels=2), "flac")]
    response = served.encode("a", items)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["token_counts"] == [75, 25]
    assert answer["grid"] == [[300], [100]]
    assert answer["embedding_dim"] == 64
    assert answer["embedding_len"] == 100


def test_hostile_audio_is_refused_naming_the_limit(served: Served) -> None:
    hour = encode(np.zeros(16_000 * 3600, np.float32), codec="flac")
    cases = {
        "long": (data_url(hour, "flac"), "more than max_audio_seconds (10 s)"),
        "rate": (data_url(clip(0.5, 96_000), "wav"), "more than max_audio_sample_rate (48000)"),
        "cut": (data_url(clip(2.0)[:20_000], "wav"), "the file is truncated"),
        "text": (data_url(b"hello, not audio", "wav"), "not an audio format"),
    }
    for req_id, (item, expected) in cases.items():
        response = served.encode(req_id, [item])
        assert response.status_code == 400, response.text
        message = response.json()["message"]
        assert message.startswith("mm_items[0]: "), message
        assert expected in message, message
        assert " at 0x" not in message


def test_images_are_refused_by_an_audio_model(served: Served) -> None:
    response = served.encode("i", [data_url(clip(1.0), "wav")], "image")
    assert response.status_code == 400
    assert "supported: audio" in response.json()["message"]
