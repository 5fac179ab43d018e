"""``"tiny-qwen3-vl"``: a seeded, randomly initialised Qwen3-VL with tiny widths.

Built from transformers' own ``Qwen3VLConfig`` (real architecture: patch size 16, learned
position embeddings, deepstack mergers), so token counts and grids are the real model's; the
embeddings are noise. Weights are fixed by the seed, so every process gets bit-identical ones.

The vision tower of ``"tiny-qwen3-vl"`` is ``model.visual`` of the full
``Qwen3VLForConditionalGeneration`` :func:`build_tiny_qwen3_vl` builds; a pipeline that needs
the matching language model calls it with the same seed.
"""

from __future__ import annotations

import copy
from typing import Any, Final

from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from ._seed import TINY_SEED, TINY_TEXT_HIDDEN_SIZE, VISION_TOKEN_IDS, seeded_build, text_config

__all__ = [
    "QWEN3_VL_IMAGE_PROCESSOR",
    "TINY_QWEN3_VL_DEEPSTACK_LAYERS",
    "build_tiny_qwen3_vl",
    "qwen3_vl_image_processor",
    "tiny_qwen3_vl_config",
]

#: Deepstack feature maps of the tiny tower (vision blocks 0 and 1 of 3), injected by the
#: language model after its decoder layers 0 and 1.
TINY_QWEN3_VL_DEEPSTACK_LAYERS: Final = 2

#: The image processor settings every released Qwen3-VL checkpoint ships
#: (``preprocessor_config.json``): 16-pixel patches, 2x2 merge, images resized to between
#: 256 and 16384 merged tokens, mean and std 0.5.
QWEN3_VL_IMAGE_PROCESSOR: Final[dict[str, Any]] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def qwen3_vl_image_processor() -> Qwen2VLImageProcessorPil:
    """The Pil image processor with Qwen3-VL's settings (a fresh object on every call).

    transformers maps ``qwen3_vl`` to ``Qwen2VLImageProcessor(Pil)``: Qwen3-VL has no image
    processor class of its own, only these settings.
    """
    return Qwen2VLImageProcessorPil(**copy.deepcopy(QWEN3_VL_IMAGE_PROCESSOR))


def tiny_qwen3_vl_config() -> Qwen3VLConfig:
    """The full config of ``"tiny-qwen3-vl"``: a 2-layer, 64-wide Qwen3-VL.

    Vision: depth 3, width 64, MLP 128, 4 heads, an 8x8 learned position grid, deepstack
    features from blocks 0 and 1, 64-wide output tokens. Text: 2 layers, 4 heads (2 KV),
    head_dim 16, interleaved M-RoPE. Image token id 500, video 501, vision start/end 502/503,
    bos 1, eos 2, pad 0. Returns a fresh object on every call.
    """
    # The sections sum to head_dim / 2 = 8; Qwen3-VL interleaves them.
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    }
    text = text_config(head_dim=16, rope_parameters=rope)
    vision = {
        "depth": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "out_hidden_size": TINY_TEXT_HIDDEN_SIZE,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": list(range(TINY_QWEN3_VL_DEEPSTACK_LAYERS)),
    }
    return Qwen3VLConfig(text_config=text, vision_config=vision, **VISION_TOKEN_IDS)


def build_tiny_qwen3_vl(*, seed: int = TINY_SEED) -> Qwen3VLForConditionalGeneration:
    """Build the seeded full tiny Qwen3-VL (float32, eval mode, CPU). Blocks for ~20 ms.

    The global torch RNG state is saved and restored around the build (see
    :func:`~encdisagg.models.build_tiny_qwen2_vl`).
    """
    return seeded_build(lambda: Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config()), seed)
