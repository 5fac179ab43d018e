"""What every tiny model shares: the seed, the text model's width and special token ids, and
the seeded build that fixes the weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

import torch

__all__ = [
    "TINY_SEED",
    "TINY_TEXT_HIDDEN_SIZE",
    "VISION_TOKEN_IDS",
    "seeded_build",
    "text_config",
]

TINY_SEED = 0
TINY_TEXT_HIDDEN_SIZE = 64

#: Special token ids inside the 512-token vocabulary (the real models' ids lie far above it).
VISION_TOKEN_IDS: Final[dict[str, Any]] = {
    "image_token_id": 500,
    "video_token_id": 501,
    "vision_start_token_id": 502,
    "vision_end_token_id": 503,
}

_M = TypeVar("_M", bound=torch.nn.Module)


def text_config(**extra: Any) -> dict[str, Any]:
    """The tiny text model: 2 layers, 64 wide, 4 heads (2 KV), bos 1, eos 2, pad 0; ``extra``
    adds the family's own entries (its rotary settings). A fresh dict on every call."""
    return {
        "vocab_size": 512,
        "hidden_size": TINY_TEXT_HIDDEN_SIZE,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        **extra,
    }


def seeded_build(build: Callable[[], _M], seed: int) -> _M:
    """``build()`` under torch seed ``seed``, in eval mode. Blocks on the build.

    The global torch RNG state is saved and restored around the build, so callers' random
    streams are undisturbed; the build itself must not race with other users of the global
    CPU generator in other threads.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    module: torch.nn.Module = model
    module.train(False)  # Module.eval via the base class, whose annotations mypy sees
    return model
