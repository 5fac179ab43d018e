"""Preprocessing and forward time of the tiny default model.

Run as ``python benchmarks/bench_models.py``; writes ``benchmarks/results/models.json``.
For each image size (448x448 and 1280x720) and batch size (1 and 8) it times, on CPU:

- ``preprocess``: decoding PNG bytes and running the real Qwen2-VL image processor for the
  batch's images, one request per image, in one thread (as one worker thread would);
- ``forward``: one fused tower call over the batch's preprocessed requests.

Each figure is the median of several repeats after one warm-up; min and max are kept too.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

from encdisagg._modality import Modality
from encdisagg.models import Preprocessed, QwenVisionModel, load_model

SIZES = {"448x448": (448, 448), "1280x720": (1280, 720)}
BATCHES = (1, 8)


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def _timed(action: Callable[[], object], repeats: int) -> dict[str, float]:
    action()  # warm-up: first calls allocate and pick kernels
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "repeats": repeats,
    }


def _preprocess_each(model: QwenVisionModel, items: list[bytes]) -> list[Preprocessed]:
    return [model.preprocess([item], Modality.IMAGE) for item in items]


def run(repeats: int) -> dict[str, object]:
    start = time.perf_counter()
    model = load_model("tiny")
    build_s = time.perf_counter() - start
    results: list[dict[str, object]] = []
    for label, (width, height) in SIZES.items():
        pngs = [_png(width, height, seed) for seed in range(max(BATCHES))]
        for batch in BATCHES:
            items = pngs[:batch]
            preprocessed = [model.preprocess([item], Modality.IMAGE) for item in items]
            tokens = sum(pre.num_tokens for pre in preprocessed)
            preprocess_timing = _timed(functools.partial(_preprocess_each, model, items), repeats)
            forward_timing = _timed(functools.partial(model.forward, preprocessed), repeats)
            results.append(
                {
                    "image": label,
                    "batch": batch,
                    "grid": list(preprocessed[0].grid[0]),
                    "tokens": tokens,
                    "preprocess": preprocess_timing,
                    "forward": forward_timing,
                    "forward_tokens_per_s": tokens / forward_timing["median_s"],
                }
            )
            print(
                f"{label:>9} batch {batch}: {tokens:5d} tokens, preprocess "
                f"{preprocess_timing['median_s'] * 1e3:7.1f} ms, "
                f"forward {forward_timing['median_s'] * 1e3:7.1f} ms"
            )
    return {
        "model": model.name,
        "model_build_s": build_s,
        "dtype": str(model.dtype).removeprefix("torch."),
        "hidden_size": model.hidden_size,
        "device": str(model.device),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "models.json",
    )
    args = parser.parse_args()
    report = run(args.repeats)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
