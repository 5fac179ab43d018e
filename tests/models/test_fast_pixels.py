"""The fast image path against transformers' PIL-backed processors, and the setting that
chooses it.

Grids and token counts must equal the processors' exactly on both paths; pixel values on the
fast path within 0.05 of the processors' normalised values (the reference path: bit for
bit); the tiny models' embeddings close to the reference path's (``EMBEDDING_ATOL``).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from transformers import Qwen2VLImageProcessorPil

from encdisagg import BadRequestError, EncoderConfig
from encdisagg._modality import Modality
from encdisagg.models import load_model, qwen3_vl_image_processor
from encdisagg.models._families._kimi_processor import Kimi_K25ImageProcessorPil
from encdisagg.models._media._limits import MediaLimits

from ._media_samples import encode, make_image

#: Fast-path pixel values against the processors' (normalised units; one uint8 level is
#: 1/255 of the range before normalising, about 0.015 after Qwen2-VL's).
PIXEL_ATOL = 0.05
#: Fast-path embeddings against the reference path's, photo-like and noise images: measured
#: at most 6e-4 (photo-like) and 4.5e-3 (noise, the worst case for any resampler) for
#: embeddings whose largest values are about 0.2.
EMBEDDING_ATOL = 1e-2
PHOTO_EMBEDDING_ATOL = 2e-3

PROCESSORS: dict[str, Callable[[], Any]] = {
    "tiny": Qwen2VLImageProcessorPil,
    "tiny-qwen3-vl": qwen3_vl_image_processor,
    "tiny-kimi-k25": Kimi_K25ImageProcessorPil,
}
MERGE = 2
# (width, height): tiny, slivers, extreme aspect ratios (just under the 200 limit), odd
# sizes, upscaled, downscaled, a photo's.
SIZES = [(1, 1), (3, 200), (200, 3), (995, 5), (7, 1000), (57, 91), (448, 448), (1280, 720)]


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A photo-like image: smooth gradients, grain and a slight blur."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = (base + rng.normal(0, 20, (height, width, 3))).clip(0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB").filter(ImageFilter.GaussianBlur(1.5))


@pytest.fixture(scope="module")
def large_jpeg() -> bytes:
    """A 4000x3000 photo-like JPEG (made small, then enlarged: quick to build)."""
    return encode(photo(800, 600, seed=7).resize((4000, 3000)), "JPEG", quality=85)


@pytest.fixture(scope="module", params=list(PROCESSORS))
def family(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    """A family's model on each path, built once per module."""
    name: str = request.param
    return name, load_model(name), load_model(name, preprocess="reference")


def _hf(name: str, image: Image.Image) -> tuple[torch.Tensor, list[list[int]]]:
    out = PROCESSORS[name]()(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"].tolist()


def _check_against_hf(
    name: str, fast: Any, reference: Any, item: object, image: Image.Image, **options: Any
) -> None:
    values, grid = _hf(name, image)
    tokens = (grid[0][1] * grid[0][2]) // (MERGE * MERGE)
    for model in (fast, reference):
        pre = model.preprocess([item], Modality.IMAGE, **options)
        assert [list(row) for row in pre.grid] == grid, (model.preprocess_mode, image.size)
        assert pre.token_counts == (tokens,)
        ours = pre.features["pixel_values"]
        assert ours.shape == values.shape
        assert ours.dtype == torch.float32
        if model.preprocess_mode == "reference":
            assert torch.equal(ours, values)
        else:
            torch.testing.assert_close(ours, values, atol=PIXEL_ATOL, rtol=0)


class TestSetting:
    def test_default_is_fast_and_reference_is_kept(self, family: tuple[str, Any, Any]) -> None:
        _, fast, reference = family
        assert fast.preprocess_mode == "fast"
        assert reference.preprocess_mode == "reference"
        # The paths' pixels differ slightly: their cache entries never mix.
        assert fast.identity != reference.identity
        assert EncoderConfig().preprocess == "fast"
        assert EncoderConfig(preprocess="reference").preprocess == "reference"

    def test_unknown_modes_are_refused_naming_the_field(self) -> None:
        message = r"preprocess must be one of fast, reference, device; got 'turbo'"
        with pytest.raises(BadRequestError, match=message):
            EncoderConfig(preprocess="turbo")
        with pytest.raises(BadRequestError, match=message):
            EncoderConfig.from_mapping({"preprocess": "turbo"})
        with pytest.raises(BadRequestError, match=message):
            load_model("tiny", preprocess="turbo")
        with pytest.raises(BadRequestError, match="preprocess must be a string, got an integer"):
            EncoderConfig.from_mapping({"preprocess": 1})


class TestAgainstTheProcessors:
    @pytest.mark.parametrize(("width", "height"), SIZES)
    def test_grids_tokens_and_pixels(
        self, family: tuple[str, Any, Any], width: int, height: int
    ) -> None:
        name, fast, reference = family
        image = photo(width, height, seed=width + height)
        _check_against_hf(name, fast, reference, encode(image), image)

    def test_noise_images(self, family: tuple[str, Any, Any]) -> None:
        # Every pixel differs from its neighbours: the hardest input for two resamplers.
        name, fast, reference = family
        for width, height in [(300, 200), (90, 1000)]:
            image = make_image(width, height, seed=3)
            _check_against_hf(name, fast, reference, image, image)

    def test_an_over_budget_jpeg_is_decoded_reduced(
        self, family: tuple[str, Any, Any], large_jpeg: bytes
    ) -> None:
        name, fast, reference = family
        data = large_jpeg
        # Over max_image_pixels: Pillow decodes it at half size (Image.draft), and the
        # processors see that image.
        with Image.open(io.BytesIO(data)) as opened:
            opened.draft("RGB", (2000, 1500))
            decoded = opened.convert("RGB")
        assert decoded.size == (2000, 1500)
        limits = MediaLimits(max_image_pixels=4_000_000)
        _check_against_hf(name, fast, reference, data, decoded, limits=limits)

    def test_too_wide_is_refused_on_both_paths(self, family: tuple[str, Any, Any]) -> None:
        name, fast, reference = family
        if name == "tiny-kimi-k25":
            pytest.skip("Kimi's rule has no aspect-ratio limit")
        for model in (fast, reference):
            with pytest.raises(BadRequestError, match=r"mm_items\[0\]: cannot preprocess image"):
                model.preprocess([make_image(1000, 2)], Modality.IMAGE)


class TestEmbeddings:
    def test_close_to_the_reference_path(self, family: tuple[str, Any, Any]) -> None:
        _, fast, reference = family
        cases = [(photo(640, 360, 1), PHOTO_EMBEDDING_ATOL), (make_image(300, 200, 1), None)]
        for image, atol in cases:
            (ours,) = fast.forward([fast.preprocess([image], Modality.IMAGE)])
            (theirs,) = reference.forward([reference.preprocess([image], Modality.IMAGE)])
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs, atol=atol or EMBEDDING_ATOL, rtol=0)

    def test_a_batch_of_sizes_splits_like_single_items(self, family: tuple[str, Any, Any]) -> None:
        _, fast, _ = family
        images = [photo(120, 90, 1), photo(64, 300, 2), photo(448, 448, 3)]
        batched = fast.preprocess(images, Modality.IMAGE)
        for number, image in enumerate(images):
            alone = fast.preprocess([image], Modality.IMAGE)
            assert batched.grid[number] == alone.grid[0]
        assert batched.cache_key != fast.preprocess(images[::-1], Modality.IMAGE).cache_key


class TestVideos:
    @pytest.mark.parametrize("name", ["tiny", "tiny-qwen3-vl"])
    def test_frames_match_the_processor_path(self, name: str) -> None:
        fast, reference = load_model(name), load_model(name, preprocess="reference")
        for count, width, height in [(1, 64, 48), (5, 320, 180), (4, 1000, 7)]:
            clip = [photo(width, height, seed=n) for n in range(count)]
            ours = fast.preprocess([clip], Modality.VIDEO)
            theirs = reference.preprocess([clip], Modality.VIDEO)
            assert ours.grid == theirs.grid
            assert ours.token_counts == theirs.token_counts
            assert ours.video_timing == theirs.video_timing
            torch.testing.assert_close(
                ours.features["pixel_values"],
                theirs.features["pixel_values"],
                atol=PIXEL_ATOL,
                rtol=0,
            )
