"""Kimi-K2.5 vision: grids and token counts against transformers' own processor arithmetic
and model, the seeded tiny default, checkpoints, and batches that split back per item."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25Model

from encdisagg import BadRequestError, InternalError
from encdisagg._modality import Modality
from encdisagg.models import (
    BUILTIN_MODELS,
    KimiVisionModel,
    Preprocessed,
    VisionModel,
    kimi_grid_patches,
    kimi_grid_tokens,
    load_model,
    select_grid,
)
from encdisagg.models._families._kimi_processor import Kimi_K25ImageProcessorPil, navit_size
from encdisagg.models._tiny._kimi import build_tiny_kimi_k25, tiny_kimi_k25_config

from ._hf_source import upstream_function
from ._media_samples import encode, make_image

_UPSTREAM = "kimi_k25/image_processing_kimi_k25"
# (width, height): square, 720p, small, below one patch, shrunk by the patch budget, and one
# capped per side.
SIZES = [(448, 448), (1280, 720), (100, 60), (10, 10), (3000, 2000), (7300, 30)]


@pytest.fixture(scope="module")
def kimi() -> KimiVisionModel:
    model = load_model("tiny-kimi-k25")
    assert isinstance(model, KimiVisionModel)
    return model


@pytest.fixture(scope="module")
def upstream_model(kimi: KimiVisionModel) -> Kimi_K25Model:
    """transformers' full Kimi-K2.5 model (tiny), holding the tiny encoder's weights."""
    model = Kimi_K25Model(tiny_kimi_k25_config())
    missing, unexpected = model.load_state_dict(kimi.tower.state_dict(), strict=False)
    assert not unexpected
    assert all(key.startswith("language_model.") for key in missing)
    model.train(False)
    return model


def test_satisfies_the_protocol(kimi: KimiVisionModel) -> None:
    assert isinstance(kimi, VisionModel)
    assert kimi.hidden_size == 64
    assert kimi.dtype == torch.float32
    assert kimi.merge_kernel_size == (2, 2)
    assert kimi.modalities == frozenset({Modality.IMAGE})
    assert "tiny-kimi-k25" in BUILTIN_MODELS


class TestAgainstUpstream:
    @pytest.mark.parametrize(("width", "height"), SIZES)
    def test_resize_rule_is_upstreams(self, width: int, height: int) -> None:
        navit_resize = upstream_function(_UPSTREAM, "navit_resize")
        for max_patches in (16384, 4096, 256):
            ours = navit_size(
                height,
                width,
                patch_size=14,
                merge_size=2,
                max_patches=max_patches,
                max_side_patches=512,
            )
            assert ours == navit_resize(height, width, 14, 2, max_patches, 512)

    @pytest.mark.parametrize(("width", "height"), SIZES)
    def test_grid_and_tokens_match_upstream(
        self, kimi: KimiVisionModel, width: int, height: int
    ) -> None:
        patches_of = upstream_function(
            _UPSTREAM, "get_number_of_image_patches", owner="Kimi_K25ImageProcessor"
        )
        pre = kimi.preprocess([make_image(width, height, seed=width)], Modality.IMAGE)
        ((t, h, w),) = pre.grid
        assert t == 1
        assert h * w == patches_of(Kimi_K25ImageProcessorPil(), height, width)
        # The processor's placeholder count (patches // merge**2) and the grid helper agree.
        assert pre.token_counts == (h * w // 4,)
        assert pre.token_counts == (kimi_grid_tokens((t, h, w), (2, 2)),)
        assert pre.features["pixel_values"].shape == (h * w, 3, 14, 14)
        assert kimi_grid_patches((t, h, w)) == h * w

    @pytest.mark.parametrize("grid", [(1, 4, 6), (4, 4, 6), (3, 8, 2)])
    def test_grid_helpers_match_upstream_pooling(
        self, upstream_model: Kimi_K25Model, grid: tuple[int, int, int]
    ) -> None:
        # Clips of t frames: t*h*w patches in, h*w/4 pooled tokens out (time is averaged).
        pixels = torch.randn(kimi_grid_patches(grid), 3, 14, 14, generator=torch.Generator())
        with torch.inference_mode():
            pooled = upstream_model.vision_tower(pixels, torch.tensor([grid])).pooler_output
        assert pooled.shape[0] == kimi_grid_tokens(grid, (2, 2))

    def test_processor_output_is_read_as_grid_thws(self, kimi: KimiVisionModel) -> None:
        pre = kimi.preprocess([make_image(100, 60)], Modality.IMAGE)
        name, value = select_grid(pre.features, Modality.IMAGE, model_type="kimi_k25")
        assert name == "grid_thws"
        assert value.tolist() == [list(pre.grid[0])]

    def test_embeddings_equal_upstream_image_features(
        self, kimi: KimiVisionModel, upstream_model: Kimi_K25Model
    ) -> None:
        first = kimi.preprocess([make_image(448, 448, 1), make_image(100, 60, 2)], "image")
        second = kimi.preprocess([make_image(280, 196, 3)], "image")
        ours = kimi.forward([first, second])
        pixels = torch.cat([first.features["pixel_values"], second.features["pixel_values"]])
        grids = torch.cat([first.features["grid_thws"], second.features["grid_thws"]])
        with torch.inference_mode():
            theirs = upstream_model.get_image_features(pixels, grids).pooler_output
        assert [piece.shape[0] for piece in theirs] == [*first.token_counts, *second.token_counts]
        assert torch.equal(ours[0], torch.cat(theirs[:2]))
        assert torch.equal(ours[1], theirs[2])
        # Unbatched too: one image alone.
        (alone,) = kimi.forward([second])
        with torch.inference_mode():
            (upstream_alone,) = upstream_model.get_image_features(
                second.features["pixel_values"], second.features["grid_thws"]
            ).pooler_output
        assert torch.equal(alone, upstream_alone)


class TestForward:
    def test_mixed_sizes_split_back_per_item(self, kimi: KimiVisionModel) -> None:
        requests = [
            kimi.preprocess([make_image(448, 448, 4), encode(make_image(64, 200, 5))], "image"),
            kimi.preprocess([make_image(1280, 720, 6)], "image"),
            kimi.preprocess([make_image(30, 30, 7)], "image"),
        ]
        fused = kimi.forward(requests)
        assert [out.shape for out in fused] == [(pre.num_tokens, 64) for pre in requests]
        for out, pre in zip(fused, requests, strict=True):
            (single,) = kimi.forward([pre])
            torch.testing.assert_close(out, single, rtol=1e-4, atol=1e-5)
        assert len({out.untyped_storage().data_ptr() for out in fused}) == 3
        assert not any(out.is_inference() for out in fused)

    def test_foreign_preprocessed_is_internal_error(self, kimi: KimiVisionModel) -> None:
        with pytest.raises(InternalError, match="not preprocessed by model"):
            kimi.forward([Preprocessed(token_counts=(4,), grid=((1, 4, 4),))])

    def test_empty_batch_and_request(self, kimi: KimiVisionModel) -> None:
        assert kimi.forward([]) == []
        empty = kimi.preprocess([], "image")
        assert [out.shape for out in kimi.forward([empty])] == [(0, 64)]

    def test_video_is_refused_naming_the_modality(self, kimi: KimiVisionModel) -> None:
        with pytest.raises(BadRequestError, match="modality 'video'"):
            kimi.preprocess([[make_image(56, 56)]], Modality.VIDEO)

    def test_cache_key_follows_content(self, kimi: KimiVisionModel) -> None:
        image = make_image(120, 80, 8)
        first = kimi.preprocess([image], "image")
        assert first.cache_key == kimi.preprocess([encode(image)], "image").cache_key
        assert first.cache_key != kimi.preprocess([make_image(120, 80, 9)], "image").cache_key


_CHECKSUM_SCRIPT = """
import hashlib
import numpy as np
from PIL import Image
from encdisagg.models import load_model
model = load_model("tiny-kimi-k25")
pixels = np.random.default_rng(3).integers(0, 256, (200, 300, 3), dtype=np.uint8)
pre = model.preprocess([Image.fromarray(pixels, "RGB")], "image")
(out,) = model.forward([pre])
print(model.identity, pre.cache_key, hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""


def test_tiny_is_deterministic_across_processes(kimi: KimiVisionModel) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CHECKSUM_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    identity, cache_key, checksum = result.stdout.split()
    pre = kimi.preprocess([make_image(300, 200, 3)], "image")
    (out,) = kimi.forward([pre])
    assert identity == kimi.identity
    assert cache_key == pre.cache_key
    assert checksum == hashlib.sha256(out.numpy().tobytes()).hexdigest()


def test_building_keeps_the_global_rng_untouched() -> None:
    before = torch.random.get_rng_state()
    build_tiny_kimi_k25()
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.fixture(scope="module")
def probe(kimi: KimiVisionModel) -> Preprocessed:
    return kimi.preprocess([make_image(448, 448, 10), make_image(90, 150, 11)], "image")


class TestCheckpoints:
    def test_round_trip_is_bit_identical(
        self, kimi: KimiVisionModel, probe: Preprocessed, tmp_path: Path
    ) -> None:
        kimi.save_pretrained(tmp_path)
        saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
        assert saved["image_processor_type"] == "Kimi_K25ImageProcessor"
        loaded = load_model(tmp_path)
        assert isinstance(loaded, KimiVisionModel)
        assert loaded.identity == kimi.identity
        again = loaded.preprocess([make_image(448, 448, 10), make_image(90, 150, 11)], "image")
        assert again.cache_key == probe.cache_key
        assert torch.equal(loaded.forward([again])[0], kimi.forward([probe])[0])

    def test_round_trip_in_bfloat16(self, kimi: KimiVisionModel, tmp_path: Path) -> None:
        model = load_model("tiny-kimi-k25", dtype="bfloat16")
        model.save_pretrained(tmp_path)
        loaded = load_model(tmp_path)
        assert loaded.dtype == torch.bfloat16
        pre = model.preprocess([make_image(112, 112, 12)], "image")
        assert torch.equal(loaded.forward([pre])[0], model.forward([pre])[0])

    def test_full_checkpoint_loads_its_vision_half(
        self, kimi: KimiVisionModel, probe: Preprocessed, tmp_path: Path
    ) -> None:
        # transformers 5's layout of a whole Kimi-K2.5: everything under ``model.``, with a
        # language model this encoder skips.
        kimi.save_pretrained(tmp_path)
        weights = {f"model.{key}": value for key, value in kimi.tower.state_dict().items()}
        weights["model.language_model.embed_tokens.weight"] = torch.zeros(4, 4)
        weights["lm_head.weight"] = torch.zeros(4, 4)
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "model.safetensors")
        loaded = load_model(tmp_path)
        assert loaded.identity == kimi.identity
        assert torch.equal(loaded.forward([probe])[0], kimi.forward([probe])[0])

    def test_missing_weights_are_refused(self, kimi: KimiVisionModel, tmp_path: Path) -> None:
        kimi.save_pretrained(tmp_path)
        weights = {k: v for k, v in kimi.tower.state_dict().items() if "mm_projector" not in k}
        save_file(weights, tmp_path / "model.safetensors")
        with pytest.raises(BadRequestError, match=r"lacks \d+ vision encoder weights"):
            load_model(tmp_path)

    def test_missing_processor_is_refused(self, kimi: KimiVisionModel, tmp_path: Path) -> None:
        kimi.save_pretrained(tmp_path)
        (tmp_path / "preprocessor_config.json").unlink()
        with pytest.raises(BadRequestError, match=r"no preprocessor_config\.json"):
            load_model(tmp_path)

    def test_processor_must_match_the_tower(self, kimi: KimiVisionModel, tmp_path: Path) -> None:
        kimi.save_pretrained(tmp_path)
        Kimi_K25ImageProcessorPil(patch_size=16).save_pretrained(tmp_path)
        with pytest.raises(BadRequestError, match="patch_size=16"):
            load_model(tmp_path)


def test_budget_refusal_names_the_limit(kimi: KimiVisionModel) -> None:
    from encdisagg.models._media._limits import MediaLimits

    with pytest.raises(BadRequestError, match="max_request_pixels"):
        kimi.preprocess(
            [make_image(448, 448), make_image(448, 448)],
            "image",
            limits=MediaLimits(max_request_pixels=300_000),
        )


def test_images_load_from_files(kimi: KimiVisionModel, tmp_path: Path) -> None:
    path = tmp_path / "image.png"
    Image.new("RGB", (64, 40), "red").save(path)
    assert kimi.preprocess([str(path)], "image").grid == ((1, 4, 6),)
