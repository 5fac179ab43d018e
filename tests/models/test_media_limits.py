"""Media budgets: decided from headers before decoding, each refusal naming item and limit."""

from __future__ import annotations

import base64

import pytest
from PIL import Image

from encdisagg import BadRequestError
from encdisagg.models import MediaPolicy, QwenVisionModel, load_image, load_video
from encdisagg.models._media._limits import (
    DEFAULT_MAX_ITEMS,
    DEFAULT_MAX_REQUEST_PIXELS,
    MediaLimits,
    PixelBudget,
    ResizeRule,
    derived_image_pixels,
)

from ._hostile_samples import gif_bomb, png_bomb
from ._media_samples import encode, make_image

POLICY = MediaPolicy()
IMAGE_RULE = ResizeRule(28, 56 * 56, 28 * 28 * 1280)
VIDEO_RULE = ResizeRule(28, 128 * 28 * 28, 768 * 28 * 28)


def budget(**limits: int) -> PixelBudget:
    chosen = MediaLimits(**limits)  # type: ignore[arg-type]
    return PixelBudget(
        chosen,
        image_pixels=chosen.max_image_pixels or derived_image_pixels(IMAGE_RULE.max_pixels),
        image_rule=IMAGE_RULE,
        video_rule=VIDEO_RULE,
    )


class TestLimits:
    def test_defaults(self) -> None:
        limits = MediaLimits()
        assert limits.max_items == DEFAULT_MAX_ITEMS == 128
        assert limits.max_image_pixels is None
        assert limits.max_request_pixels == DEFAULT_MAX_REQUEST_PIXELS
        # Four times the tiny model's max_pixels is under 4K UHD: the floor wins.
        assert derived_image_pixels(1_003_520) == 3840 * 2160
        assert derived_image_pixels(12_845_056) == 4 * 12_845_056

    @pytest.mark.parametrize("field", ["max_items", "max_image_pixels", "max_request_pixels"])
    @pytest.mark.parametrize("value", [0, -1, True, 1.5])
    def test_fields_are_validated(self, field: str, value: object) -> None:
        with pytest.raises(BadRequestError, match=field):
            MediaLimits(**{field: value})  # type: ignore[arg-type]

    def test_too_many_items(self) -> None:
        MediaLimits(max_items=3).check_items(3)
        with pytest.raises(
            BadRequestError, match=r"mm_items has 4 items, more than max_items_per_request \(3\)"
        ):
            MediaLimits(max_items=3).check_items(4)

    def test_model_pixels_follow_the_resize_rule(self) -> None:
        assert IMAGE_RULE.model_pixels(448, 448) == 448 * 448
        assert IMAGE_RULE.model_pixels(13000, 13000) <= IMAGE_RULE.max_pixels
        # Tiny frames are upscaled to the video minimum: they cost what the model processes.
        assert VIDEO_RULE.model_pixels(64, 64) == 336 * 336


class TestImages:
    def test_large_png_is_refused_from_its_header(self) -> None:
        data = png_bomb(9000, 9000)
        with pytest.raises(
            BadRequestError,
            match=r"mm_items\[2\]: image is 9000x9000 \(81000000 pixels\), more than "
            r"max_image_pixels \(8294400\)",
        ):
            load_image(data, 2, POLICY, budget=budget())

    def test_large_jpeg_is_decoded_reduced(self) -> None:
        picture = make_image(400, 300, seed=3)
        image = load_image(encode(picture, "JPEG"), 0, POLICY, budget=budget(max_image_pixels=9000))
        # Halved (200x150) is still too large; a quarter (100x75) fits.
        assert image.size == (100, 75)
        assert image.mode == "RGB"

    def test_jpeg_too_large_even_reduced_is_refused(self) -> None:
        data = encode(make_image(400, 300), "JPEG")
        with pytest.raises(
            BadRequestError, match=r"mm_items\[0\]: image is 400x300 .*max_image_pix"
        ):
            load_image(data, 0, POLICY, budget=budget(max_image_pixels=100))

    def test_images_within_budget_are_untouched(self) -> None:
        picture = make_image(64, 48, seed=1)
        image = load_image(
            encode(picture, "JPEG"), 0, POLICY, budget=budget(max_image_pixels=64 * 48)
        )
        assert image.size == (64, 48)

    def test_request_pixels_are_counted_after_resizing(self) -> None:
        pixels = budget(max_request_pixels=2 * 448 * 448 + 1)
        item = encode(Image.new("RGB", (448, 448)))
        load_image(item, 0, POLICY, budget=pixels)
        load_image(item, 1, POLICY, budget=pixels)
        with pytest.raises(
            BadRequestError,
            match=r"mm_items\[2\]: the request's items need 602112 pixels after resizing, "
            r"more than max_request_pixels \(401409\)",
        ):
            load_image(item, 2, POLICY, budget=pixels)

    @pytest.mark.parametrize(
        "item", ["data:image/png;base64,", b"", "", {"url": "data:image/png;base64,"}]
    )
    def test_empty_items_say_so(self, item: object) -> None:
        with pytest.raises(BadRequestError, match=r"^mm_items\[0\]: the item is empty"):
            load_image(item, 0, POLICY)

    def test_messages_never_show_addresses(self) -> None:
        junk = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
        with pytest.raises(BadRequestError) as caught:
            load_image(junk, 0, POLICY)
        assert "0x" not in caught.value.message
        assert "BytesIO" not in caught.value.message
        assert caught.value.message.startswith("mm_items[0]: cannot decode image")


class TestVideos:
    def test_long_gif_is_sampled_while_decoding(self) -> None:
        data = gif_bomb(10_000, 64, 64)
        pixels = budget()
        frames = load_video(data, 0, POLICY, budget=pixels)
        frame_cost = VIDEO_RULE.model_pixels(64, 64)
        assert len(frames) == DEFAULT_MAX_REQUEST_PIXELS // frame_cost
        assert pixels.remaining < frame_cost
        # Evenly spread: the last kept frame lies near the end of the file.
        assert frames[-1].convert("1").getbbox() is not None

    def test_large_canvas_keeps_few_frames(self) -> None:
        frames = load_video(gif_bomb(150, 1000, 1000), 3, POLICY, budget=budget())
        # No more decoded frames than the request's pixels, at their source size.
        assert len(frames) == DEFAULT_MAX_REQUEST_PIXELS // (1000 * 1000)
        assert all(frame.size == (1000, 1000) for frame in frames)

    def test_video_with_no_room_left_is_refused(self) -> None:
        pixels = budget(max_request_pixels=VIDEO_RULE.model_pixels(64, 64) + 50_000)
        load_image(encode(Image.new("RGB", (64, 64))), 0, POLICY, budget=pixels, video=True)
        with pytest.raises(BadRequestError, match=r"mm_items\[1\]: .*max_request_pixels"):
            load_video(gif_bomb(4, 64, 64), 1, POLICY, budget=pixels)

    def test_walking_too_many_frames_is_refused(self) -> None:
        # 10,000 frames on a 1000x1000 canvas (230 KB): each is composited on the canvas
        # on the way to the sampled ones, 16 x max_request_pixels at most.
        with pytest.raises(
            BadRequestError,
            match=r"mm_items\[0\]: reaching the sampled frames decodes 9376 frames of "
            r"1000x1000 .*16 x max_request_pixels",
        ):
            load_video(gif_bomb(10_000, 1000, 1000), 0, POLICY, budget=budget())

    def test_frame_lists_are_budgeted_per_frame(self) -> None:
        pixels = budget(max_request_pixels=2 * VIDEO_RULE.model_pixels(64, 64))
        frames = [encode(make_image(64, 64, seed=seed)) for seed in range(3)]
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]\[2\]: .*max_request_pixels"):
            load_video(frames, 0, POLICY, budget=pixels)

    def test_sampled_frames_match_a_full_decode(self) -> None:
        frames = [make_image(16, 16, seed=seed) for seed in range(9)]
        webp = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
        pixels = budget(max_request_pixels=3 * VIDEO_RULE.model_pixels(16, 16))
        decoded = load_video(webp, 0, POLICY, budget=pixels)
        assert len(decoded) == 3
        for got, want in zip(decoded, [frames[0], frames[3], frames[6]], strict=True):
            assert got.tobytes() == want.tobytes()


class TestModel:
    def test_preprocess_applies_the_default_limits(self, tiny: QwenVisionModel) -> None:
        with pytest.raises(BadRequestError, match=r"max_items_per_request \(128\)"):
            tiny.preprocess([encode(make_image(8, 8))] * 129, "image")

    def test_preprocess_takes_limits_per_call(self, tiny: QwenVisionModel) -> None:
        assert tiny.accepts_media_limits is True
        item = encode(make_image(64, 64))
        with pytest.raises(BadRequestError, match=r"max_items_per_request \(1\)"):
            tiny.preprocess([item, item], "image", limits=MediaLimits(max_items=1))
        pre = tiny.preprocess([item, item], "image")
        assert len(pre.token_counts) == 2

    def test_hostile_gif_encodes_a_bounded_sample(self, tiny: QwenVisionModel) -> None:
        pre = tiny.preprocess([gif_bomb(150, 1000, 1000)], "video")
        frames = DEFAULT_MAX_REQUEST_PIXELS // (1000 * 1000)
        assert pre.grid[0][0] == frames // 2
        # Pixel values of the kept frames only (12 bytes per model pixel per frame).
        assert pre.features["pixel_values"].nbytes <= frames * VIDEO_RULE.max_pixels * 12
