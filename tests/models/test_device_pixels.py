"""The ``"device"`` preprocess mode: the fast image path's kernels on the model's device.

With the CPU as the device it must be the ``"fast"`` mode exactly: pixel values, grids, token
counts and cache keys (a fleet mixing the two shares a global cache). The float kernels that
stand in for the ``uint8`` ones on other devices are checked here on the CPU against the
processors' tolerance; the device-marked test compares an accelerator's output with the
host's (``ENCDISAGG_TEST_DEVICE``; skipped on the CPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from encdisagg import BadRequestError, EncoderConfig
from encdisagg._config import PREPROCESS_MODES
from encdisagg._modality import Modality
from encdisagg.models import load_model
from encdisagg.models._families import _fast_pixels

from .._device import chosen_device
from ._media_samples import encode, make_image
from .test_fast_pixels import PIXEL_ATOL, PROCESSORS, _hf, photo

# (width, height): upscaled, slivers, odd, exactly the grid (no resize), downscaled.
SIZES = [(1, 1), (995, 5), (57, 91), (448, 448), (1280, 720)]
VIDEO_MODELS = ("tiny", "tiny-qwen3-vl")


@pytest.fixture(scope="module", params=list(PROCESSORS))
def pair(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    """A family's model in the ``"fast"`` and the ``"device"`` mode, both on the CPU."""
    name: str = request.param
    return name, load_model(name), load_model(name, preprocess="device")


def _assert_same(ours: Any, theirs: Any) -> None:
    assert ours.grid == theirs.grid
    assert ours.token_counts == theirs.token_counts
    assert ours.video_timing == theirs.video_timing
    assert ours.cache_key == theirs.cache_key
    for key, value in theirs.features.items():
        assert torch.equal(ours.features[key], value), key


class TestTheSetting:
    def test_the_mode_is_named_and_shares_the_fast_identity(
        self, pair: tuple[str, Any, Any]
    ) -> None:
        name, fast, device = pair
        assert device.preprocess_mode == "device"
        # Equal resized pixels give equal values on either path: one cache namespace.
        assert device.identity == fast.identity
        assert device.identity != load_model(name, preprocess="reference").identity
        assert EncoderConfig(preprocess="device").preprocess == "device"
        assert "device" in PREPROCESS_MODES

    def test_unknown_modes_still_name_the_field(self) -> None:
        message = r"preprocess must be one of fast, reference, device; got 'gpu'"
        with pytest.raises(BadRequestError, match=message):
            load_model("tiny", preprocess="gpu")
        with pytest.raises(BadRequestError, match=message):
            EncoderConfig(preprocess="gpu")

    def test_audio_models_take_and_ignore_it(self) -> None:
        model = load_model("tiny-qwen2-audio", preprocess="device")
        assert model.modalities == frozenset({Modality.AUDIO})


class TestOnTheCpu:
    @pytest.mark.parametrize(("width", "height"), SIZES)
    def test_images_equal_the_fast_mode(
        self, pair: tuple[str, Any, Any], width: int, height: int
    ) -> None:
        _, fast, device = pair
        image = photo(width, height, seed=width * height)
        for item in (encode(image), make_image(width, height, seed=width)):
            ours = device.preprocess([item], Modality.IMAGE)
            _assert_same(ours, fast.preprocess([item], Modality.IMAGE))
            assert ours.features["pixel_values"].device.type == "cpu"

    def test_a_request_of_several_images_and_its_embedding(
        self, pair: tuple[str, Any, Any]
    ) -> None:
        _, fast, device = pair
        images = [photo(120, 90, 1), make_image(64, 300, 2), photo(640, 360, 3)]
        ours, theirs = (
            device.preprocess(images, Modality.IMAGE),
            fast.preprocess(images, Modality.IMAGE),
        )
        _assert_same(ours, theirs)
        (mine,) = device.forward([ours])
        (reference,) = fast.forward([theirs])
        assert torch.equal(mine, reference)

    @pytest.mark.parametrize("name", VIDEO_MODELS)
    def test_videos_equal_the_fast_mode(self, name: str) -> None:
        fast, device = load_model(name), load_model(name, preprocess="device")
        for count, width, height in [(1, 64, 48), (5, 320, 180), (9, 200, 300)]:
            clip = [photo(width, height, seed=n) for n in range(count)]
            _assert_same(
                device.preprocess([clip], Modality.VIDEO), fast.preprocess([clip], Modality.VIDEO)
            )


class TestTheFloatKernels:
    """Where torch has no ``uint8`` resampling (accelerators), floats stand in: run here by
    pretending the CPU lacks the ``uint8`` kernels."""

    @pytest.fixture
    def floats(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_fast_pixels, "has_uint8_kernels", lambda device: False)

    @pytest.mark.usefixtures("floats")
    def test_within_the_tolerance_of_the_processors(self, pair: tuple[str, Any, Any]) -> None:
        name, fast, device = pair
        # Photo-like at the fast path's sizes, noise at those its own tests hold to the
        # tolerance (noise elsewhere is the worst case for any two resamplers).
        images = [photo(w, h, seed=5) for w, h in [(57, 91), (995, 5), (1280, 720)]]
        images += [make_image(300, 200, seed=3), make_image(90, 1000, seed=3)]
        for image in images:
            values, grid = _hf(name, image)
            ours = device.preprocess([image], Modality.IMAGE)
            assert [list(row) for row in ours.grid] == grid
            pixels = ours.features["pixel_values"]
            torch.testing.assert_close(pixels, values, atol=PIXEL_ATOL, rtol=0)
            # Within two uint8 levels of the uint8 kernels' values.
            exact = fast.preprocess([image], Modality.IMAGE).features["pixel_values"]
            assert ((pixels - exact).abs() / fast._pixels.scale.max()).max() <= 2.001


@pytest.fixture
def where() -> torch.device:
    """``ENCDISAGG_TEST_DEVICE``, where it names an accelerator."""
    device = chosen_device()
    if device.type == "cpu":
        pytest.skip("on the CPU the mode is the fast mode bit for bit (TestOnTheCpu)")
    return device


@pytest.mark.device
class TestOnTheDevice:
    """The mode on ``ENCDISAGG_TEST_DEVICE``: values within ``PIXEL_ATOL`` of the host's
    fast path, the same grids and token counts, the values already on the device."""

    def test_images_and_a_video(self, where: torch.device, pair: tuple[str, Any, Any]) -> None:
        name, host, _ = pair
        model = load_model(name, device=str(where), preprocess="device")
        requests: list[tuple[list[Any], Modality]] = [
            ([photo(w, h, seed=w) for w, h in SIZES], Modality.IMAGE),
            ([make_image(300, 200, 1), make_image(90, 1000, 2)], Modality.IMAGE),
        ]
        if name in VIDEO_MODELS:
            requests.append(([[photo(320, 180, seed=n) for n in range(5)]], Modality.VIDEO))
        for items, modality in requests:
            ours, theirs = model.preprocess(items, modality), host.preprocess(items, modality)
            assert (ours.grid, ours.token_counts) == (theirs.grid, theirs.token_counts)
            assert ours.video_timing == theirs.video_timing
            values = ours.features["pixel_values"]
            assert values.device == model.device
            torch.testing.assert_close(
                values.cpu(), theirs.features["pixel_values"], atol=PIXEL_ATOL, rtol=0
            )
            (rows,) = model.forward([ours])
            assert rows.shape[0] == sum(ours.token_counts)
