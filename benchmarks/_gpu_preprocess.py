"""Step ``preprocess``: images/s of the fast image path on the host against the same kernels
on the device (``preprocess = "device"``), for a 1280x720 and a 1920x1080 JPEG.

Both run the tiny Qwen2-VL model (``tiny``): preprocessing depends on the processor's
settings (Qwen2-VL's defaults, which size these images as Qwen2.5-VL-7B's processor does),
not on the tower. One image per call from one thread, with one torch thread on the host, as
``bench_preprocess.py`` measures it; a device call returns once the device has made the
pixel values. Each figure is the median of its repeats after a warm-up. The cell also
reports how far the device's pixel values are from the host's and whether their cache keys
agree. On the CPU the ``"device"`` mode runs there too: a check of the path, not a figure.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np
from _gpu_common import Row, device_name, row, synchronize

SIZES: Final = {"1280x720": (1280, 720), "1920x1080": (1920, 1080)}
#: Calls per timed repeat.
CALLS: Final = 10


def jpeg(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG: gradients and grain (what a camera's file costs to decode)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = (base + rng.normal(0, 12, (height, width, 3))).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _images_per_s(action: Callable[[], object], repeats: int) -> float:
    action()  # warm-up: kernels are chosen and memory allocated on the first call
    rates = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for _ in range(CALLS):
            action()
        rates.append(CALLS / (time.perf_counter() - start))
    return statistics.median(rates)


def preprocess_step(device: str, repeats: int) -> Row:
    """Host against device preprocessing, per size."""
    import torch

    from encdisagg import Modality
    from encdisagg.models import Preprocessed, load_model

    started = time.perf_counter()
    torch.set_num_threads(1)  # per core, as the host figures elsewhere are
    host = load_model("tiny")
    on_device = load_model("tiny", device=device, preprocess="device")
    cells: list[dict[str, Any]] = []
    for label, (width, height) in SIZES.items():
        data = jpeg(width, height, seed=width)

        def on_host(data: bytes = data) -> Preprocessed:
            return host.preprocess([data], Modality.IMAGE)

        def there(data: bytes = data) -> Preprocessed:
            pre = on_device.preprocess([data], Modality.IMAGE)
            synchronize(device)
            return pre

        mine, theirs = there(), on_host()
        values = mine.features["pixel_values"]
        difference = values.cpu() - theirs.features["pixel_values"]
        host_rate = _images_per_s(on_host, repeats)
        device_rate = _images_per_s(there, repeats)
        cells.append(
            {
                "image": f"{label} JPEG",
                "host_images_per_s": round(host_rate, 1),
                "device_images_per_s": round(device_rate, 1),
                "device_vs_host": round(device_rate / host_rate, 2),
                "values_on": str(values.device),
                "max_abs_diff": round(float(difference.abs().max()), 4),
                "cache_keys_equal": mine.cache_key == theirs.cache_key,
            }
        )
    figures: dict[str, Any] = {
        "device": device,
        "device_name": device_name(device),
        "calls_per_repeat": CALLS,
        "repeats": repeats,
        "cells": cells,
    }
    if device.startswith("cuda"):
        figures["peak_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return row("preprocess", "ok", seconds=time.perf_counter() - started, figures=figures)
