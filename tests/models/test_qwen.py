from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

from encdisagg import BadRequestError, InternalError
from encdisagg._modality import Modality
from encdisagg.models import Preprocessed, QwenVisionModel, VisionModel

from ._media_samples import encode, make_image


@pytest.fixture(scope="module")
def square() -> Image.Image:
    return make_image(448, 448, seed=1)


@pytest.fixture(scope="module")
def wide() -> Image.Image:
    return make_image(1280, 720, seed=2)


@pytest.fixture(scope="module")
def square_pre(tiny: QwenVisionModel, square: Image.Image) -> Preprocessed:
    return tiny.preprocess([square], Modality.IMAGE)


def test_satisfies_the_protocol(tiny: QwenVisionModel, tiny25: QwenVisionModel) -> None:
    assert isinstance(tiny, VisionModel)
    assert isinstance(tiny25, VisionModel)
    assert tiny.hidden_size == tiny25.hidden_size == 64
    assert tiny.dtype == torch.float32
    assert tiny.name == "tiny"
    assert tiny25.name == "tiny-qwen2.5-vl"
    assert tiny.merge_size == 2


class TestTokenCounts:
    def test_448_square(self, square_pre: Preprocessed) -> None:
        assert square_pre.grid == ((1, 32, 32),)
        assert square_pre.token_counts == (256,)
        assert square_pre.features["pixel_values"].shape == (1024, 3 * 2 * 14 * 14)

    def test_720p(self, tiny: QwenVisionModel, wide: Image.Image) -> None:
        pre = tiny.preprocess([encode(wide, "JPEG", quality=95)], Modality.IMAGE)
        assert pre.grid == ((1, 52, 92),)
        assert pre.token_counts == (1196,)

    def test_several_images_in_one_request(
        self, tiny: QwenVisionModel, square: Image.Image, wide: Image.Image
    ) -> None:
        small = make_image(100, 60, seed=5)
        pre = tiny.preprocess([square, wide, encode(small)], "image")
        assert pre.grid == ((1, 32, 32), (1, 52, 92), (1, 4, 8))
        assert pre.token_counts == (256, 1196, 8)
        assert pre.num_tokens == 1460
        assert pre.features["pixel_values"].shape[0] == 1024 + 4784 + 32
        assert pre.features["grid_thw"].tolist() == [[1, 32, 32], [1, 52, 92], [1, 4, 8]]

    def test_video_frames_pair_up_in_time(self, tiny: QwenVisionModel) -> None:
        frames = [make_image(112, 112, seed=seed) for seed in range(4)]
        pre = tiny.preprocess([frames], Modality.VIDEO)
        # Frames are resized to at least 128 merged patches (336x336), 2 frames per step.
        assert pre.grid == ((2, 24, 24),)
        assert pre.token_counts == (2 * 24 * 24 // 4,)
        odd = tiny.preprocess([frames[:3]], Modality.VIDEO)
        assert odd.grid == ((2, 24, 24),)  # the last frame is repeated to fill the pair

    def test_two_videos_and_an_animated_file(self, tiny: QwenVisionModel) -> None:
        frames = [make_image(448, 448, seed=seed) for seed in range(6)]
        webp = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:4], lossless=True)
        pre = tiny.preprocess([frames, webp], Modality.VIDEO)
        assert pre.grid == ((3, 32, 32), (2, 32, 32))
        assert pre.token_counts == (768, 512)

    def test_video_file_with_pyav(self, tiny: QwenVisionModel, tmp_path: Path) -> None:
        av = pytest.importorskip("av")
        path = tmp_path / "clip.mp4"
        with av.open(str(path), "w") as container:
            stream = container.add_stream("mpeg4", rate=2)
            stream.width, stream.height = 448, 448
            for seed in range(4):
                frame = av.VideoFrame.from_image(make_image(448, 448, seed=seed))
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
        pre = tiny.preprocess([path.read_bytes()], Modality.VIDEO)
        assert pre.grid == ((2, 32, 32),)

    def test_tiny_qwen25_counts_the_same(
        self, tiny25: QwenVisionModel, square: Image.Image, wide: Image.Image
    ) -> None:
        pre = tiny25.preprocess([square, wide], Modality.IMAGE)
        assert pre.token_counts == (256, 1196)


class TestVideoLayout:
    """Video patches follow the video processor's layout: per row, channel, time, pixel."""

    def test_identical_frames_equal_the_image(self, tiny: QwenVisionModel) -> None:
        frame = make_image(448, 448, seed=9)
        video = tiny.preprocess([[frame, frame]], Modality.VIDEO)
        image = tiny.preprocess([frame], Modality.IMAGE)
        assert video.grid == image.grid == ((1, 32, 32),)
        assert torch.equal(video.features["pixel_values"], image.features["pixel_values"])

    def test_each_frame_fills_its_temporal_slot(self, tiny: QwenVisionModel) -> None:
        a, b = make_image(448, 448, seed=10), make_image(448, 448, seed=11)
        video = tiny.preprocess([[a, b]], Modality.VIDEO).features["pixel_values"]
        only_a = tiny.preprocess([a], Modality.IMAGE).features["pixel_values"]
        only_b = tiny.preprocess([b], Modality.IMAGE).features["pixel_values"]
        # [patches, channel, time, 14*14]
        slots = video.view(-1, 3, 2, 196)
        assert torch.equal(slots[:, :, 0], only_a.view(-1, 3, 2, 196)[:, :, 0])
        assert torch.equal(slots[:, :, 1], only_b.view(-1, 3, 2, 196)[:, :, 0])

    def test_frames_must_share_a_size(self, tiny: QwenVisionModel) -> None:
        frames = [make_image(64, 64), make_image(64, 64), make_image(64, 48)]
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]\[2\]: frame is 64x48"):
            tiny.preprocess([frames], Modality.VIDEO)


class TestBadInput:
    def test_unsupported_modality(self, tiny: QwenVisionModel, square: Image.Image) -> None:
        with pytest.raises(BadRequestError, match="modality 'audio' is not supported") as info:
            tiny.preprocess([square], Modality.AUDIO)
        assert info.value.status == 400
        with pytest.raises(BadRequestError, match="modality must be one of"):
            tiny.preprocess([square], "smell")

    def test_bad_media_names_the_item(self, tiny: QwenVisionModel, square: Image.Image) -> None:
        with pytest.raises(BadRequestError, match=r"mm_items\[1\]: cannot decode image"):
            tiny.preprocess([square, b"\x89PNG broken"], Modality.IMAGE)

    def test_processor_rejections_name_the_item(self, tiny: QwenVisionModel) -> None:
        sliver = make_image(1000, 2)  # aspect ratio above 200
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: cannot preprocess image"):
            tiny.preprocess([sliver], Modality.IMAGE)

    def test_items_must_be_a_list(self, tiny: QwenVisionModel) -> None:
        with pytest.raises(BadRequestError, match="mm_items must be a list"):
            tiny.preprocess(b"bytes", Modality.IMAGE)

    def test_no_items(self, tiny: QwenVisionModel) -> None:
        pre = tiny.preprocess([], Modality.IMAGE)
        assert pre.token_counts == ()
        assert pre.cache_key is None
        (out,) = tiny.forward([pre])
        assert out.shape == (0, 64)


class TestForward:
    def test_shapes_and_dtype(self, tiny: QwenVisionModel, square_pre: Preprocessed) -> None:
        (out,) = tiny.forward([square_pre])
        assert out.shape == (256, 64)
        assert out.dtype == tiny.dtype
        assert out.is_contiguous()
        assert torch.isfinite(out).all()
        assert not out.requires_grad
        assert not out.is_inference()  # callers may update it in place
        out.mul_(2)

    def test_fused_batch_splits_per_element(
        self, tiny: QwenVisionModel, square_pre: Preprocessed
    ) -> None:
        medium = make_image(280, 196, seed=6)  # grid (1, 14, 20): 70 tokens
        first = tiny.preprocess([medium, make_image(200, 300, seed=7)], Modality.IMAGE)
        second = square_pre
        third = tiny.preprocess([medium], Modality.IMAGE)
        outputs = tiny.forward([first, second, third])
        assert [out.shape[0] for out in outputs] == [first.num_tokens, 256, 70]
        alone = [tiny.forward([pre])[0] for pre in (first, second, third)]
        for fused, single in zip(outputs, alone, strict=True):
            torch.testing.assert_close(fused, single, rtol=1e-4, atol=1e-5)
        # Attention never crosses images: the same image embeds alike in both requests.
        torch.testing.assert_close(outputs[0][:70], outputs[2], rtol=1e-4, atol=1e-5)
        # Each element owns its memory.
        pointers = {out.untyped_storage().data_ptr() for out in outputs}
        assert len(pointers) == 3

    def test_video_forward(self, tiny: QwenVisionModel) -> None:
        frames = [make_image(112, 112, seed=seed) for seed in range(4)]
        pre = tiny.preprocess([frames], Modality.VIDEO)
        (out,) = tiny.forward([pre])
        assert out.shape == (288, 64)

    def test_token_mismatch_is_internal_error(
        self, tiny: QwenVisionModel, square_pre: Preprocessed
    ) -> None:
        lying = Preprocessed(
            token_counts=(255,), grid=square_pre.grid, features=square_pre.features
        )
        message = "Encoder produced 256 tokens, but preprocessor metadata expected 255"
        with pytest.raises(InternalError, match=message) as info:
            tiny.forward([lying])
        assert info.value.status == 500

    def test_foreign_preprocessed_is_internal_error(self, tiny: QwenVisionModel) -> None:
        foreign = Preprocessed(token_counts=(4,), grid=((1, 4, 4),), features={"fill": (1.0,)})
        with pytest.raises(InternalError, match=r"batch\[0\] has no pixel_values"):
            tiny.forward([foreign])

    def test_empty_batch(self, tiny: QwenVisionModel) -> None:
        assert tiny.forward([]) == []

    def test_qwen25_forward(self, tiny25: QwenVisionModel, square: Image.Image) -> None:
        pre = tiny25.preprocess([square, make_image(300, 200, seed=4)], Modality.IMAGE)
        (out,) = tiny25.forward([pre])
        assert out.shape == (pre.num_tokens, 64)
        assert torch.isfinite(out).all()


class TestCacheKey:
    def test_same_content_same_key(self, tiny: QwenVisionModel, square: Image.Image) -> None:
        from_image = tiny.preprocess([square], Modality.IMAGE)
        from_png = tiny.preprocess([encode(square)], Modality.IMAGE)
        assert from_image.cache_key is not None
        assert len(from_image.cache_key) == 64
        assert from_image.cache_key == from_png.cache_key

    def test_any_difference_changes_the_key(
        self, tiny: QwenVisionModel, tiny25: QwenVisionModel, square: Image.Image
    ) -> None:
        keys = {
            tiny.preprocess([square], Modality.IMAGE).cache_key,
            tiny.preprocess([square, square], Modality.IMAGE).cache_key,
            tiny.preprocess([make_image(448, 448, seed=99)], Modality.IMAGE).cache_key,
            tiny.preprocess([square.transpose(Image.Transpose.FLIP_LEFT_RIGHT)], "image").cache_key,
            # Same pixels, other model: another identity.
            tiny25.preprocess([square], Modality.IMAGE).cache_key,
        }
        assert len(keys) == 5
        assert tiny.identity != tiny25.identity


class TestThreads:
    def test_concurrent_preprocess_matches_serial(self, tiny: QwenVisionModel) -> None:
        images = [make_image(160 + 28 * n, 120, seed=n) for n in range(6)]
        serial = [tiny.preprocess([image], Modality.IMAGE) for image in images]
        with ThreadPoolExecutor(max_workers=3) as pool:
            parallel = list(
                pool.map(lambda image: tiny.preprocess([image], Modality.IMAGE), images * 2)
            )
        for got, want in zip(parallel, serial * 2, strict=True):
            assert got.cache_key == want.cache_key
            assert got.grid == want.grid

    def test_forward_from_another_thread(
        self, tiny: QwenVisionModel, square_pre: Preprocessed
    ) -> None:
        (here,) = tiny.forward([square_pre])
        result: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: result.extend(tiny.forward([square_pre])))
        worker.start()
        worker.join()
        assert torch.equal(result[0], here)
