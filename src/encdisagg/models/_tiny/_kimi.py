"""The embedded ``"tiny-kimi-k25"``: a seeded, randomly initialised Kimi-K2.5 vision encoder.

Built from transformers' own ``Kimi_K25Config`` with tiny widths: the grids and token counts
are the real model's (patch size 14, a 2x2 merge kernel, the real processor settings), the
embeddings are noise. The weights are fixed by the seed, so every process that builds it gets
bit-identical ones.
"""

from __future__ import annotations

from typing import Any

from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

from .._families._kimi import KimiK25VisionEncoder
from ._seed import TINY_SEED, TINY_TEXT_HIDDEN_SIZE, seeded_build

__all__ = ["build_tiny_kimi_k25", "tiny_kimi_k25_config"]


def _text_config() -> dict[str, Any]:
    # Only hidden_size reaches the encoder (the projector's output width); the rest keeps
    # the DeepSeek-V3 text config small and valid.
    return {
        "model_type": "deepseek_v3",
        "vocab_size": 512,
        "hidden_size": TINY_TEXT_HIDDEN_SIZE,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    }


def tiny_kimi_k25_config() -> Kimi_K25Config:
    """The config of ``"tiny-kimi-k25"``: a 2-layer, 64-wide Kimi-K2.5 vision tower.

    The tower has 4 heads, an MLP of 128, a 16x16 learned position grid, 4 temporal
    positions, patch size 14 and a 2x2 merge kernel; the projector maps each 2x2 block
    (4 x 64 values) to one 64-wide token, the text model's hidden size. Returns a fresh
    object on every call.
    """
    vision: dict[str, Any] = {
        "patch_size": 14,
        "pos_emb_height": 16,
        "pos_emb_width": 16,
        "pos_emb_time": 4,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "merge_kernel_size": [2, 2],
    }
    return Kimi_K25Config(
        vision_config=vision,
        text_config=_text_config(),
        projection_hidden_size=vision["hidden_size"],
    )


def build_tiny_kimi_k25(*, seed: int = TINY_SEED) -> KimiK25VisionEncoder:
    """Build the seeded tiny Kimi-K2.5 vision encoder (float32, eval mode, CPU). Blocks
    for ~10 ms.

    The global torch RNG state is saved and restored around the build, as for
    :func:`~encdisagg.models.build_tiny_qwen2_vl`.
    """
    return seeded_build(lambda: KimiK25VisionEncoder(tiny_kimi_k25_config()), seed)
