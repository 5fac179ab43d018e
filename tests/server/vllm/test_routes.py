"""``--wire vllm`` with shared storage: the proxy's call answered, each item's file written.

Served by the app of the test's flavour (Quart on asyncio, QuartTrio on Trio); one test runs
real Hypercorn, one data-parallel workers. The metadata per family is checked against the
rows the file holds (vLLM's placeholder count) and the values our processors computed.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch
from PIL import Image
from quart import Quart
from safetensors.torch import load_file

from encdisagg import Encoder
from encdisagg.server import ServerSettings, create_app

from ...models._audio_samples import clip
from .._helpers import fast_config, png_data_url, running
from ..test_sglang_routes import reference_bytes
from ._bodies import chat_body, image_item, mooncake_params

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def _file(root: Path, uuid: str) -> torch.Tensor:
    return load_file(str(root / uuid / "encoder_cache.safetensors"))["ec_cache"]


def _nothing_written(root: Path) -> bool:
    return not any(root.iterdir())


def gif_data_url(frames: int = 4, size: int = 56, ms: int = 250) -> str:
    """An animated GIF (a video our Encoder reads without PyAV): ``1000 / ms`` fps."""
    images = [Image.new("RGB", (size, size), (40 * n, 255 - 30 * n, 7 * n)) for n in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=ms)
    return "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()


def wav_base64(seconds: float = 1.0) -> str:
    return base64.b64encode(clip(seconds)).decode()


async def test_an_image_is_written_where_vllm_reads_it_and_answered(
    make_app: Callable[..., Quart], tmp_path: Path
) -> None:
    encoder = Encoder(fast_config())
    app = make_app(encoder, wire="vllm", vllm_storage_path=str(tmp_path))
    item = png_data_url(seed=5)
    async with running(app) as client:
        assert (await client.get("/health")).status_code == 200
        body = chat_body(
            image_item("u0", seed=5), image_item("u1", seed=6), image_item("u0", seed=5)
        )
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, await response.get_data()
        answer = await response.get_json()
        assert encoder.stats().live_requests == 0
        expected = await reference_bytes(encoder, item)
    assert answer["ec_transfer_params"] == {
        "u0": {
            "modality": "image",
            "item_indices": [0, 2],
            "metadata": {"image_grid_thw": [1, 16, 16]},
        },
        "u1": {
            "modality": "image",
            "item_indices": [1],
            "metadata": {"image_grid_thw": [1, 16, 16]},
        },
    }
    tensor = _file(tmp_path, "u0")
    assert tensor.shape == (64, 64)  # t·h·w / merge² rows
    assert tensor.numpy().tobytes() == expected


async def test_the_pd_dtype_is_written(make_app: Callable[..., Quart], tmp_path: Path) -> None:
    app = make_app(wire="vllm", vllm_storage_path=str(tmp_path), vllm_dtype="bf16")
    async with running(app) as client:
        response = await client.post(CHAT, json=chat_body(image_item("u")))
        assert response.status_code == 200
    assert _file(tmp_path, "u").dtype == torch.bfloat16


def _video_item(uuid: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": gif_data_url()}, "uuid": uuid}


def _audio_item(uuid: str) -> dict[str, Any]:
    return {
        "type": "input_audio",
        "input_audio": {"data": wav_base64(), "format": "wav"},
        "uuid": uuid,
    }


def _audio_url_item(uuid: str) -> dict[str, Any]:
    url = "data:audio/wav;base64," + wav_base64()
    return {"type": "audio_url", "audio_url": {"url": url}, "uuid": uuid}


def _omni_rows(frames: int) -> int:
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


@pytest.mark.parametrize(
    ("model", "item", "keys"),
    [
        ("tiny-qwen2.5-vl", _video_item, {"video_grid_thw"}),
        ("tiny-qwen3-vl", _video_item, {"video_grid_thw", "timestamps"}),
        ("tiny-qwen3-vl", lambda uuid: image_item(uuid), {"image_grid_thw"}),
        ("tiny-qwen2-audio", _audio_item, {"audio_num_tokens"}),
        ("tiny-qwen2.5-omni-audio", _audio_url_item, {"audio_feature_lengths"}),
    ],
)
async def test_metadata_per_family(
    make_app: Callable[..., Quart],
    tmp_path: Path,
    model: str,
    item: Callable[[str], dict[str, Any]],
    keys: set[str],
) -> None:
    encoder = Encoder(fast_config(model=model))
    app = make_app(encoder, wire="vllm", vllm_storage_path=str(tmp_path))
    async with running(app) as client:
        response = await client.post(CHAT, json=chat_body(item("x")))
        assert response.status_code == 200, await response.get_data()
        entry = (await response.get_json())["ec_transfer_params"]["x"]
    metadata = entry["metadata"]
    assert set(metadata) == keys
    tensor = _file(tmp_path, "x")
    rows, width = tensor.shape
    assert width == encoder.model.hidden_size  # Qwen3-VL: main columns, then each deepstack map
    grid = metadata.get("image_grid_thw") or metadata.get("video_grid_thw")
    if grid is not None:
        t, h, w = grid
        assert rows == t * h * w // 4
    if "timestamps" in metadata:
        assert len(metadata["timestamps"]) == grid[0]
        assert metadata["timestamps"] == sorted(metadata["timestamps"])
    if "audio_num_tokens" in metadata:
        assert metadata["audio_num_tokens"] == [rows]
    if "audio_feature_lengths" in metadata:
        (frames,) = metadata["audio_feature_lengths"]
        assert frames == 100  # 1 s of 16 kHz at a 160-sample hop
        assert rows == _omni_rows(frames)


async def test_kimi_is_refused_in_vllms_error_shape(
    make_app: Callable[..., Quart], tmp_path: Path
) -> None:
    app = make_app(fast_config(model="tiny-kimi-k25"), wire="vllm", vllm_storage_path=str(tmp_path))
    async with running(app) as client:
        response = await client.post(CHAT, json=chat_body(image_item("k")))
        assert response.status_code == 400
        error = (await response.get_json())["error"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert "Kimi-K2.5" in error["message"]
    assert _nothing_written(tmp_path)


async def test_the_drain_refuses_new_calls_with_503_in_vllms_error_shape(
    make_app: Callable[..., Quart], tmp_path: Path
) -> None:
    app = make_app(wire="vllm", vllm_storage_path=str(tmp_path))
    async with running(app) as client:
        app.extensions["encdisagg"].refuse_encodes()
        response = await client.post(CHAT, json=chat_body(image_item("late")))
        assert response.status_code == 503
        assert response.headers["Retry-After"]
        error = (await response.get_json())["error"]
    assert error["code"] == 503
    assert "draining" in error["message"]
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (chat_body(image_item(None)), "uuid is missing"),
        (chat_body(image_item("u"), mm_processor_kwargs={"max_pixels": 1}), "mm_processor_kwargs"),
        (
            chat_body(image_item("u"), ec_transfer_params=mooncake_params("tcp://h:1", "t")),
            "writes shared storage",
        ),
        (chat_body(_audio_item("a")), "audio items"),
    ],
)
async def test_refusals_answer_400_naming_why(
    make_app: Callable[..., Quart], tmp_path: Path, body: dict[str, Any], says: str
) -> None:
    app = make_app(wire="vllm", vllm_storage_path=str(tmp_path))
    async with running(app) as client:
        response = await client.post(CHAT, json=body)
        assert response.status_code == 400
        answer = await response.get_json()
    assert set(answer) == {"error"}
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert says in answer["error"]["message"]
    if says == "uuid is missing":
        assert answer["error"]["param"] == "messages[0].content[0].uuid"


async def test_bad_media_names_the_item(make_app: Callable[..., Quart], tmp_path: Path) -> None:
    app = make_app(wire="vllm", vllm_storage_path=str(tmp_path))
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": "b"}
    async with running(app) as client:
        response = await client.post(CHAT, json=chat_body(image_item("g"), broken))
        assert response.status_code == 400
        message = (await response.get_json())["error"]["message"]
    assert message.startswith("media item 1 (uuid 'b'): ")


async def test_served_by_hypercorn(anyio_backend_name: str, tmp_path: Path) -> None:
    from encdisagg.server import bind_socket, serve

    settings = ServerSettings(wire="vllm", vllm_storage_path=str(tmp_path))
    app = create_app(fast_config(), settings=settings, flavour=anyio_backend_name)  # type: ignore[arg-type]
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    stop = anyio.Event()
    serving = anyio.Event()
    async with anyio.create_task_group() as group:
        group.start_soon(
            lambda: serve(
                app, sock=sock, shutdown_trigger=stop.wait, on_serving=lambda url: serving.set()
            )
        )
        with anyio.fail_after(60):
            await serving.wait()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert (await client.get("/health")).status_code == 200
            response = await client.post(CHAT, json=chat_body(image_item("h")))
            assert response.status_code == 200, response.text
            # The file was in place before the answer went out.
            assert (tmp_path / "h" / "encoder_cache.safetensors").is_file()
        stop.set()
    assert _file(tmp_path, "h").shape == (64, 64)


# One event loop: starting worker processes (each imports torch) is what takes the time here,
# and the front's loop is covered by every other test.
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_data_parallel_workers(make_app: Callable[..., Quart], tmp_path: Path) -> None:
    app = make_app(fast_config(), dp=2, wire="vllm", vllm_storage_path=str(tmp_path))
    async with running(app) as client:
        body = chat_body(*(image_item(f"d{n}", seed=n) for n in range(4)))
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, await response.get_data()
        answer = await response.get_json()
    assert sorted(answer["ec_transfer_params"]) == ["d0", "d1", "d2", "d3"]
    for n in range(4):
        assert _file(tmp_path, f"d{n}").shape == (64, 64)
