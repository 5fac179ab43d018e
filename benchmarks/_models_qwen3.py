"""The tiny-qwen3-vl row of the per-family model benchmark: preprocess and forward time.

``bench_qwen3_vl()`` returns one row (a plain dict) for a typical input, a 1280x720 PNG
image: ``preprocess`` decodes the bytes and runs the Pil image processor with Qwen3-VL's
settings; ``forward`` is one tower call, which returns the main embedding and the two deepstack
maps side by side (``[tokens, 64 * 3]``). Medians of several repeats after one warm-up.

Run as ``python benchmarks/_models_qwen3.py`` to print the row as JSON.
"""

from __future__ import annotations

import functools
import io
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
from PIL import Image

from encdisagg._modality import Modality
from encdisagg.models import Qwen3VisionModel, load_model

#: The typical input: one 720p image.
WIDTH, HEIGHT = 1280, 720


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def _median_s(action: Callable[[], object], repeats: int) -> float:
    action()  # warm-up: first calls allocate and pick kernels
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def bench_qwen3_vl(repeats: int = 5) -> dict[str, object]:
    """One row: family, model, input, grid, tokens, widths, preprocess and forward medians."""
    start = time.perf_counter()
    model = load_model("tiny-qwen3-vl")
    build_s = time.perf_counter() - start
    assert isinstance(model, Qwen3VisionModel)
    item = _png(WIDTH, HEIGHT, seed=0)
    preprocessed = model.preprocess([item], Modality.IMAGE)
    preprocess_s = _median_s(functools.partial(model.preprocess, [item], Modality.IMAGE), repeats)
    forward_s = _median_s(functools.partial(model.forward, [preprocessed]), repeats)
    return {
        "family": "qwen3_vl",
        "model": model.name,
        "modality": "image",
        "input": f"{WIDTH}x{HEIGHT} PNG",
        "grid": list(preprocessed.grid[0]),
        "tokens": preprocessed.num_tokens,
        "embedding_width": model.hidden_size,
        "deepstack_layers": model.deepstack_layers,
        "model_build_s": build_s,
        "preprocess_ms": preprocess_s * 1e3,
        "forward_ms": forward_s * 1e3,
        "repeats": repeats,
    }


if __name__ == "__main__":
    print(json.dumps(bench_qwen3_vl(), indent=2))
