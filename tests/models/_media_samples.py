"""Real images made with PIL, deterministic per seed."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A noise image: every pixel matters to the embedding."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def encode(image: Image.Image, fmt: str = "PNG", **options: object) -> bytes:
    """``image`` saved in ``fmt`` (any PIL writer)."""
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()
