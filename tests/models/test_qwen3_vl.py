"""The Qwen3-VL adapter against transformers' own processor and model, checkpoints, batches."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import (
    Qwen2VLImageProcessorPil,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLMoeVisionConfig,
)
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_video_resize
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from encdisagg import BadRequestError
from encdisagg._modality import Modality
from encdisagg.models import (
    BUILTIN_MODELS,
    Preprocessed,
    Qwen3VisionModel,
    VisionModel,
    build_tiny_qwen3_vl,
    load_model,
    qwen3_vl_image_processor,
    split_embedding,
)
from encdisagg.transfer import EmbeddingLayout

from ._media_samples import encode, make_image

# (width, height) of test images: below the minimum pixels (upscaled), odd sizes, wide.
SIZES = [(56, 56), (100, 70), (300, 200), (640, 360)]


@pytest.fixture(scope="module")
def qwen3() -> Qwen3VisionModel:
    model = load_model("tiny-qwen3-vl")
    assert isinstance(model, Qwen3VisionModel)
    return model


@pytest.fixture(scope="module")
def reference() -> Qwen3VisionModel:
    """The same model on the processor's own path: its pixels are transformers' bit for bit,
    so its embeddings must equal the HF model's exactly (tests/models/test_fast_pixels.py
    holds the fast path to its tolerance)."""
    model = load_model("tiny-qwen3-vl", preprocess="reference")
    assert isinstance(model, Qwen3VisionModel)
    return model


@pytest.fixture(scope="module")
def full() -> Qwen3VLForConditionalGeneration:
    """The whole tiny Qwen3-VL the built-in tower comes from (same seed)."""
    return build_tiny_qwen3_vl()


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    return [make_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]


def hf_reference(
    full: Qwen3VLForConditionalGeneration, images: list[Image.Image]
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Grid, per-item embeddings and per-item deepstack maps as transformers computes them."""
    processed = qwen3_vl_image_processor()(images=images, return_tensors="pt")
    with torch.inference_mode():
        out = full.model.get_image_features(
            processed["pixel_values"], processed["image_grid_thw"], return_dict=True
        )
    per_item = tuple(
        torch.cat([main, *maps], dim=1)
        for main, *maps in zip(out.pooler_output, *out.deepstack_features, strict=True)
    )
    return processed["image_grid_thw"], per_item, tuple(out.pooler_output)


def test_satisfies_the_protocol_and_names_its_layout(qwen3: Qwen3VisionModel) -> None:
    assert isinstance(qwen3, VisionModel)
    assert "tiny-qwen3-vl" in BUILTIN_MODELS
    assert qwen3.token_width == 64
    assert qwen3.deepstack_layers == 2
    assert qwen3.hidden_size == 64 * 3
    assert qwen3.embedding_layout == EmbeddingLayout(
        (("embedding", 64), ("deepstack_0", 64), ("deepstack_1", 64))
    )
    assert qwen3.merge_size == 2
    assert qwen3.modalities == {Modality.IMAGE, Modality.VIDEO}


def test_token_counts_and_grids_equal_the_hf_processor(
    qwen3: Qwen3VisionModel, images: list[Image.Image]
) -> None:
    processor = qwen3_vl_image_processor()
    for image in images:  # unbatched
        pre = qwen3.preprocess([encode(image)], Modality.IMAGE)
        grid = processor(images=[image], return_tensors="pt")["image_grid_thw"]
        assert pre.grid == tuple(tuple(row) for row in grid.tolist())
        patches = processor.get_number_of_image_patches(image.height, image.width, {})
        assert pre.token_counts == (patches // 4,)
    batched = qwen3.preprocess([encode(image) for image in images], "image")
    grid = processor(images=images, return_tensors="pt")["image_grid_thw"]
    assert batched.grid == tuple(tuple(row) for row in grid.tolist())
    assert batched.token_counts == tuple(int(row.prod()) // 4 for row in grid)
    assert min(batched.token_counts) == 64  # 256 patches at least: Qwen3-VL's minimum


def test_embeddings_and_deepstack_equal_the_hf_model_batched_and_not(
    reference: Qwen3VisionModel, full: Qwen3VLForConditionalGeneration, images: list[Image.Image]
) -> None:
    qwen3 = reference
    _, expected, mains = hf_reference(full, images)
    batched = qwen3.preprocess(images, Modality.IMAGE)
    (joint,) = qwen3.forward([batched])
    pieces = split_embedding(joint, batched.token_counts)
    for piece, want, main in zip(pieces, expected, mains, strict=True):
        assert torch.equal(piece, want)
        assert torch.equal(qwen3.embedding_layout.split(piece)["embedding"], main)
    for image, want in zip(images, expected, strict=True):
        _, (alone,), _ = hf_reference(full, [image])
        (ours,) = qwen3.forward([qwen3.preprocess([image], Modality.IMAGE)])
        assert torch.equal(ours, alone)
        torch.testing.assert_close(ours, want)  # batching only reorders float sums


def test_a_mixed_batch_splits_back_per_item_exactly(
    reference: Qwen3VisionModel, full: Qwen3VLForConditionalGeneration, images: list[Image.Image]
) -> None:
    qwen3 = reference
    first = qwen3.preprocess(images[:1], Modality.IMAGE)
    rest = qwen3.preprocess(images[1:], Modality.IMAGE)
    empty = Preprocessed(token_counts=(), grid=())
    outputs = qwen3.forward([first, empty, rest])
    assert [tuple(out.shape) for out in outputs] == [
        (first.num_tokens, 192),
        (0, 192),
        (rest.num_tokens, 192),
    ]
    # The fused call is the HF model's over the same concatenated input, item for item.
    _, expected, _ = hf_reference(full, images)
    items = [outputs[0], *split_embedding(outputs[2], rest.token_counts)]
    for got, want in zip(items, expected, strict=True):
        assert torch.equal(got, want)
        assert got.is_contiguous()


def test_video_grid_equals_the_hf_video_processor(qwen3: Qwen3VisionModel) -> None:
    # Qwen3VLVideoProcessor needs torchvision to run; the grid it makes comes from its module's
    # smart_resize under the checkpoint's video settings, which needs nothing more.
    for frames, width, height in [(2, 64, 48), (5, 80, 64), (8, 640, 360), (16, 1280, 720)]:
        clip = [make_image(width, height, seed=n) for n in range(frames)]
        pre = qwen3.preprocess([clip], Modality.VIDEO)
        (grid,) = pre.grid
        resized_height, resized_width = hf_video_resize(
            frames,
            height,
            width,
            temporal_factor=2,
            factor=16 * 2,
            min_pixels=128 * 32 * 32,
            max_pixels=768 * 32 * 32,
        )
        patches = -(-frames // 2) * (resized_height // 16) * (resized_width // 16)
        assert tuple(grid) == (-(-frames // 2), resized_height // 16, resized_width // 16)
        assert pre.features["pixel_values"].shape == (patches, 3 * 2 * 16 * 16)
        (out,) = qwen3.forward([pre])
        assert tuple(out.shape) == (patches // 4, 192)


def test_video_timestamps_equal_the_hf_processor(qwen3: Qwen3VisionModel) -> None:
    clip = [make_image(64, 48, seed=n) for n in range(5)]
    pre = qwen3.preprocess([{"frames": clip, "fps": 4}, clip], Modality.VIDEO)
    assert pre.video_timing is not None
    given, default = pre.video_timing
    # _calculate_timestamps reads nothing of its processor: call it on the frame indices.
    assert given.timestamps == pytest.approx(
        Qwen3VLProcessor._calculate_timestamps(None, list(range(5)), 4.0, 2)
    )
    assert default.timestamps == pytest.approx(
        Qwen3VLProcessor._calculate_timestamps(None, list(range(5)), 2.0, 2)
    )
    assert len(given.timestamps) == pre.grid[0][0] == 3
    assert qwen3.preprocess([clip[0]], Modality.IMAGE).video_timing is None


def test_checkpoint_round_trip_is_bit_identical(
    qwen3: Qwen3VisionModel, images: list[Image.Image], tmp_path: Path
) -> None:
    qwen3.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert isinstance(loaded, Qwen3VisionModel)
    assert loaded.identity == qwen3.identity
    assert loaded.embedding_layout == qwen3.embedding_layout
    pre = qwen3.preprocess(images, Modality.IMAGE)
    again = loaded.preprocess(images, Modality.IMAGE)
    assert again.cache_key == pre.cache_key
    assert torch.equal(loaded.forward([again])[0], qwen3.forward([pre])[0])


def test_a_full_checkpoint_loads_its_tower(
    qwen3: Qwen3VisionModel,
    full: Qwen3VLForConditionalGeneration,
    images: list[Image.Image],
    tmp_path: Path,
) -> None:
    full.save_pretrained(tmp_path)
    qwen3_vl_image_processor().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_vl"
    loaded = load_model(tmp_path)
    assert isinstance(loaded, Qwen3VisionModel)
    assert loaded.identity == qwen3.identity  # the same tower, whatever folder it came from
    pre = loaded.preprocess(images[:2], Modality.IMAGE)
    assert torch.equal(loaded.forward([pre])[0], qwen3.forward([pre])[0])


def test_a_moe_tower_checkpoint_loads(images: list[Image.Image], tmp_path: Path) -> None:
    config = Qwen3VLMoeVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=48,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )
    torch.manual_seed(3)
    Qwen3VLMoeVisionModel(config).save_pretrained(tmp_path)
    qwen3_vl_image_processor().save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert isinstance(loaded, Qwen3VisionModel)
    assert loaded.embedding_layout.sections == (("embedding", 48), ("deepstack_0", 48))
    pre = loaded.preprocess(images[:2], Modality.IMAGE)
    (out,) = loaded.forward([pre])
    assert tuple(out.shape) == (pre.num_tokens, 96)


def test_a_full_moe_checkpoint_loads_its_tower(images: list[Image.Image], tmp_path: Path) -> None:
    dense = build_tiny_qwen3_vl().config.to_dict()
    text = {
        **dense["text_config"],
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    config = Qwen3VLMoeConfig(
        text_config=text,
        vision_config=dense["vision_config"],
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
    )
    torch.manual_seed(4)
    full = Qwen3VLMoeForConditionalGeneration(config)
    full.save_pretrained(tmp_path)
    qwen3_vl_image_processor().save_pretrained(tmp_path)
    loaded = load_model(tmp_path, preprocess="reference")  # compared with HF bit for bit
    assert isinstance(loaded, Qwen3VisionModel)
    pre = loaded.preprocess(images[:2], Modality.IMAGE)
    (ours,) = loaded.forward([pre])
    processed = qwen3_vl_image_processor()(images=images[:2], return_tensors="pt")
    with torch.inference_mode():
        out = full.model.visual(processed["pixel_values"], grid_thw=processed["image_grid_thw"])
    expected = torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
    assert torch.equal(ours, expected)


def test_a_processor_that_does_not_fit_the_tower_is_refused(
    qwen3: Qwen3VisionModel,
) -> None:
    with pytest.raises(BadRequestError, match="patch_size"):
        Qwen3VisionModel(qwen3.tower, Qwen2VLImageProcessorPil(), name="mismatch")


def test_an_unsupported_modality_names_it(qwen3: Qwen3VisionModel) -> None:
    with pytest.raises(BadRequestError, match="modality 'audio'"):
        qwen3.preprocess([b"RIFF"], Modality.AUDIO)


_CHECKSUM_SCRIPT = """
import hashlib, numpy as np
from PIL import Image
from encdisagg.models import load_model
model = load_model("tiny-qwen3-vl")
pixels = np.random.default_rng(1).integers(0, 256, (70, 100, 3), dtype=np.uint8)
pre = model.preprocess([Image.fromarray(pixels, "RGB")], "image")
(out,) = model.forward([pre])
print(model.identity, pre.cache_key, hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""


def test_the_tiny_default_is_deterministic_across_processes(
    qwen3: Qwen3VisionModel, images: list[Image.Image]
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CHECKSUM_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    identity, cache_key, checksum = result.stdout.split()
    pre = qwen3.preprocess([images[1]], "image")
    (out,) = qwen3.forward([pre])
    assert identity == qwen3.identity
    assert cache_key == pre.cache_key
    assert checksum == hashlib.sha256(out.numpy().tobytes()).hexdigest()
