"""The embedded default models: seeded, randomly initialised Qwen2-VL / Qwen2.5-VL.

Real architecture and real processor, tiny widths: token counts and grids are those of the real
models, the embeddings are noise. Weights are fixed by the seed, so every process that builds
``"tiny"`` gets bit-identical weights.

The vision tower of ``"tiny"`` *is* the ``model.visual`` part of the full
``Qwen2VLForConditionalGeneration`` that :func:`build_tiny_qwen2_vl` builds from
:func:`tiny_qwen2_vl_config`. A pipeline that needs the matching language model calls the
same function with the same seed and gets the same vision weights plus the language model
they were initialised with.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from ._seed import TINY_SEED, TINY_TEXT_HIDDEN_SIZE, VISION_TOKEN_IDS, seeded_build, text_config

__all__ = [
    "build_tiny_qwen2_5_vl",
    "build_tiny_qwen2_vl",
    "tiny_qwen2_5_vl_config",
    "tiny_qwen2_vl_config",
]


def _text_config() -> dict[str, Any]:
    # Multimodal RoPE over (t, h, w); the sections sum to head_dim / 2 = 8.
    return text_config(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})


def tiny_qwen2_vl_config() -> Qwen2VLConfig:
    """The full (vision + text) config of ``"tiny"``: a 2-layer, 64-wide Qwen2-VL.

    The vision tower has depth 2, ``embed_dim`` 64, 4 heads and ``mlp_ratio`` 2; its merger
    outputs 64-wide tokens, the text model's hidden size. Image token id 500, video 501,
    vision start/end 502/503, bos 1, eos 2, pad 0. Returns a fresh object on every call.
    """
    vision = {"depth": 2, "embed_dim": 64, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2}
    return Qwen2VLConfig(text_config=_text_config(), vision_config=vision, **VISION_TOKEN_IDS)


def tiny_qwen2_5_vl_config() -> Qwen2_5_VLConfig:
    """The full config of ``"tiny-qwen2.5-vl"``: as :func:`tiny_qwen2_vl_config`, Qwen2.5-VL.

    The vision tower has depth 2, width 64, an MLP of 128, 4 heads, window attention in
    block 0 and full attention in block 1, and 64-wide output tokens.
    """
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "out_hidden_size": TINY_TEXT_HIDDEN_SIZE,
        "fullatt_block_indexes": [1],
    }
    return Qwen2_5_VLConfig(text_config=_text_config(), vision_config=vision, **VISION_TOKEN_IDS)


def build_tiny_qwen2_vl(*, seed: int = TINY_SEED) -> Qwen2VLForConditionalGeneration:
    """Build the seeded full tiny Qwen2-VL (float32, eval mode, CPU). Blocks for ~20 ms.

    The global torch RNG state is saved and restored around the build, so callers' random
    streams are undisturbed; the build itself must not race with other users of the global
    CPU generator in other threads.
    """
    return seeded_build(lambda: Qwen2VLForConditionalGeneration(tiny_qwen2_vl_config()), seed)


def build_tiny_qwen2_5_vl(*, seed: int = TINY_SEED) -> Qwen2_5_VLForConditionalGeneration:
    """Build the seeded full tiny Qwen2.5-VL; see :func:`build_tiny_qwen2_vl`."""
    return seeded_build(lambda: Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config()), seed)
