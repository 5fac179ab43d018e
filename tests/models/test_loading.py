from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from encdisagg import BadRequestError
from encdisagg._modality import Modality
from encdisagg.models import (
    BUILTIN_MODELS,
    TINY_TEXT_HIDDEN_SIZE,
    Preprocessed,
    QwenVisionModel,
    build_tiny_qwen2_vl,
    load_model,
    tiny_qwen2_vl_config,
)
from encdisagg.models._loading import parse_dtype

from ._media_samples import encode, make_image


@pytest.fixture(scope="module")
def probe(tiny: QwenVisionModel) -> Preprocessed:
    return tiny.preprocess([make_image(224, 168, seed=12)], Modality.IMAGE)


def test_builtin_names() -> None:
    assert BUILTIN_MODELS[:2] == ("tiny", "tiny-qwen2.5-vl")
    assert "tiny-kimi-k25" in BUILTIN_MODELS  # the other families add theirs after these two


def test_tiny_is_the_visual_part_of_the_full_tiny_model(
    tiny: QwenVisionModel, probe: Preprocessed
) -> None:
    full = build_tiny_qwen2_vl()
    assert full.config.text_config.hidden_size == TINY_TEXT_HIDDEN_SIZE == tiny.hidden_size
    ours = tiny.tower.state_dict()
    theirs = full.model.visual.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    config = tiny_qwen2_vl_config()
    assert config.image_token_id == 500
    assert config.text_config.vocab_size == 512
    assert config.vision_config.hidden_size == config.text_config.hidden_size


def test_building_keeps_the_global_rng_untouched() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    load_model("tiny")
    assert torch.equal(torch.rand(3), expected)


class TestBadNames:
    def test_unknown_name(self, tmp_path: Path) -> None:
        with pytest.raises(BadRequestError, match="model: 'nope' is neither a built-in") as info:
            load_model("nope")
        assert info.value.status == 400
        with pytest.raises(BadRequestError, match=r"model: .* is neither"):
            load_model(tmp_path / "missing")

    def test_folder_without_config(self, tmp_path: Path) -> None:
        with pytest.raises(BadRequestError, match=r"model: cannot read config\.json"):
            load_model(tmp_path)

    def test_folder_of_another_architecture(self, tmp_path: Path) -> None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
        with pytest.raises(BadRequestError, match=r"model: .* is a 'llama' checkpoint"):
            load_model(tmp_path)

    def test_folder_without_weights(self, tmp_path: Path, tiny: QwenVisionModel) -> None:
        tiny.save_pretrained(tmp_path)
        (tmp_path / "model.safetensors").unlink()
        with pytest.raises(BadRequestError, match="model: cannot load checkpoint"):
            load_model(tmp_path)

    def test_folder_without_processor(self, tmp_path: Path, tiny: QwenVisionModel) -> None:
        tiny.save_pretrained(tmp_path)
        (tmp_path / "preprocessor_config.json").unlink()
        with pytest.raises(BadRequestError, match=r"has no preprocessor_config\.json"):
            load_model(tmp_path)

    def test_processor_must_match_the_tower(self, tmp_path: Path, tiny: QwenVisionModel) -> None:
        tiny.save_pretrained(tmp_path)
        config_path = tmp_path / "preprocessor_config.json"
        config = json.loads(config_path.read_text())
        config["merge_size"] = 4
        config_path.write_text(json.dumps(config))
        with pytest.raises(BadRequestError, match="merge_size=4, but its tower"):
            load_model(tmp_path)

    def test_bad_dtype_and_device(self) -> None:
        with pytest.raises(BadRequestError, match="dtype"):
            load_model("tiny", dtype="int8")
        with pytest.raises(BadRequestError, match="dtype"):
            load_model("tiny", dtype="float17")
        with pytest.raises(BadRequestError, match="device"):
            load_model("tiny", device="toaster")

    def test_bad_media_limits(self) -> None:
        with pytest.raises(BadRequestError, match="max_media_bytes"):
            load_model("tiny", max_media_bytes=0)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, None),
        ("auto", None),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("torch.float16", torch.float16),
        ("half", torch.float16),
        ("fp32", torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_parse_dtype(given: object, expected: torch.dtype | None) -> None:
    assert parse_dtype(given) == expected  # type: ignore[arg-type]


def test_dtype_applies_to_embeddings(probe: Preprocessed) -> None:
    model = load_model("tiny", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    (out,) = model.forward([probe])
    assert out.dtype == torch.bfloat16
    assert out.shape == (probe.num_tokens, 64)


def test_media_limits_reach_preprocess() -> None:
    png = encode(make_image(64, 64))
    model = load_model("tiny", max_media_bytes=len(png) - 1)
    with pytest.raises(BadRequestError, match=r"mm_items\[0\]: .*max_media_bytes"):
        model.preprocess([png], Modality.IMAGE)
    model = load_model("tiny", remote_media_domains=["example.com"])
    with pytest.raises(BadRequestError, match="not in remote_media_domains"):
        model.preprocess(["https://example.org/a.png"], Modality.IMAGE)


class TestCheckpoints:
    def test_round_trip_is_bit_identical(
        self, tmp_path: Path, tiny: QwenVisionModel, probe: Preprocessed
    ) -> None:
        tiny.save_pretrained(tmp_path)
        assert {path.name for path in tmp_path.iterdir()} >= {
            "config.json",
            "model.safetensors",
            "preprocessor_config.json",
            "video_preprocessor_config.json",
        }
        loaded = load_model(str(tmp_path))
        assert loaded.name == str(tmp_path)
        assert loaded.identity == tiny.identity
        again = loaded.preprocess([make_image(224, 168, seed=12)], Modality.IMAGE)
        assert again.cache_key == probe.cache_key
        assert torch.equal(loaded.forward([again])[0], tiny.forward([probe])[0])

    def test_round_trip_of_qwen25_in_bfloat16(self, tmp_path: Path) -> None:
        model = load_model("tiny-qwen2.5-vl", dtype="bf16")
        model.save_pretrained(tmp_path)
        loaded = load_model(tmp_path)  # the checkpoint's own dtype
        assert loaded.dtype == torch.bfloat16
        pre = model.preprocess([make_image(140, 140, seed=2)], Modality.IMAGE)
        assert torch.equal(loaded.forward([pre])[0], model.forward([pre])[0])

    def test_processor_settings_travel_with_the_checkpoint(
        self, tmp_path: Path, tiny: QwenVisionModel
    ) -> None:
        tiny.save_pretrained(tmp_path)
        config_path = tmp_path / "preprocessor_config.json"
        config = json.loads(config_path.read_text())
        config["size"] = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}
        config_path.write_text(json.dumps(config))
        video_path = tmp_path / "video_preprocessor_config.json"
        video = json.loads(video_path.read_text())
        video["size"] = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
        video_path.write_text(json.dumps(video))
        smaller = load_model(tmp_path)
        assert smaller.identity != tiny.identity
        pre = smaller.preprocess([make_image(448, 448)], Modality.IMAGE)
        assert pre.grid == ((1, 16, 16),)
        frames = [make_image(448, 448, seed=seed) for seed in range(2)]
        assert smaller.preprocess([frames], Modality.VIDEO).grid == ((1, 8, 8),)

    def test_full_qwen2_vl_checkpoint_loads_its_vision_tower(
        self, tmp_path: Path, tiny: QwenVisionModel, probe: Preprocessed
    ) -> None:
        build_tiny_qwen2_vl().save_pretrained(tmp_path)
        tiny.save_pretrained(tmp_path / "processor")
        for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
            (tmp_path / name).write_bytes((tmp_path / "processor" / name).read_bytes())
        loaded = load_model(tmp_path)
        assert loaded.identity == tiny.identity
        assert torch.equal(loaded.forward([probe])[0], tiny.forward([probe])[0])


_CHECKSUM_SCRIPT = """
import hashlib, numpy as np
from PIL import Image
from encdisagg.models import load_model
model = load_model("tiny")
pixels = np.random.default_rng(12).integers(0, 256, (168, 224, 3), dtype=np.uint8)
pre = model.preprocess([Image.fromarray(pixels, "RGB")], "image")
(out,) = model.forward([pre])
print(model.identity, pre.cache_key, hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""


def test_tiny_is_deterministic_across_processes(tiny: QwenVisionModel, probe: Preprocessed) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CHECKSUM_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    identity, cache_key, checksum = result.stdout.split()
    (out,) = tiny.forward([probe])
    assert identity == tiny.identity
    assert cache_key == probe.cache_key
    assert checksum == hashlib.sha256(out.numpy().tobytes()).hexdigest()
