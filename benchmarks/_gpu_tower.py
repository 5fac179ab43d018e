"""Step ``tower``: a real-size vision tower (Qwen2.5-VL-7B's vision config, random weights)
through encdisagg's own ``QwenVisionModel``: images/s at batches of 1, 4 and 8.

The config comes from ``qwen2_5_vl_7b_vision.json`` beside this file (the checkpoint's
``vision_config``). On an accelerator it runs as served, in bfloat16; on the CPU a scaled-down
shape (:data:`CPU_SHAPE`, float32) keeps the run short while going through the same code:
the same processor, the same ``preprocess`` and the same fused ``forward``, at batches of
1 and 2 (:data:`CPU_BATCHES`).

Preprocessing (decode the PNG, resize, normalise, patchify) is timed apart from the forward;
a batch of ``n`` is ``n`` one-image requests fused into one tower call, as the Encoder's
batcher fuses them. Each figure is the median of its repeats, after one warm-up on an accelerator.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from _gpu_common import Row, device_name, is_accelerator, png, row, synchronize

CONFIG_FILE: Final = Path(__file__).resolve().parent / "qwen2_5_vl_7b_vision.json"
SIZES: Final = {"448x448": (448, 448), "1280x720": (1280, 720)}
BATCHES: Final = (1, 4, 8)
#: The CPU run's batches: the same fused forward, fewer images to preprocess and encode.
CPU_BATCHES: Final = (1, 2)
#: The CPU run's shape: the real config with these values replaced.
CPU_SHAPE: Final = {
    "depth": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_heads": 4,
    "out_hidden_size": 256,
    "fullatt_block_indexes": [1],
}


def vision_config(device: str) -> tuple[dict[str, Any], str]:
    """The tower's config values and dtype name: the real ones on an accelerator, the
    scaled-down shape in float32 on the CPU."""
    values = {
        key: value
        for key, value in json.loads(CONFIG_FILE.read_text()).items()
        if key not in ("source", "model_type")
    }
    # The checkpoint spells it in_chans; transformers 5's config takes in_channels.
    values["in_channels"] = values.pop("in_chans")
    if is_accelerator(device):
        return values, "bfloat16"
    return {**values, **CPU_SHAPE}, "float32"


def _build(device: str) -> tuple[Any, dict[str, Any]]:
    import torch
    from transformers import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from encdisagg.models import QwenVisionModel

    values, dtype_name = vision_config(device)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    # Initialised on the device itself: 670 M random weights in seconds, not a host copy.
    with torch.device(device):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(
            Qwen2_5_VLVisionConfig(**values), dtype=dtype
        )
    model = QwenVisionModel(tower, Qwen2VLImageProcessorPil(), name="qwen2.5-vl-7b-vision")
    shape = {
        key: values[key]
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
    }
    shape["fullatt_block_indexes"] = values["fullatt_block_indexes"]
    shape["dtype"] = dtype_name
    shape["parameters"] = sum(p.numel() for p in tower.parameters())
    shape["scaled_down"] = not is_accelerator(device)
    return model, shape


def _median_s(action: Callable[[], object], repeats: int, device: str) -> float:
    if device != "cpu":
        action()  # warm-up: kernels are chosen and memory allocated on the first call
        synchronize(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def tower_step(device: str, repeats: int) -> Row:
    """Build the tower on ``device``, then time preprocess and forward per size and batch."""
    from encdisagg import Modality

    started = time.perf_counter()
    model, shape = _build(device)
    synchronize(device)
    build_s = time.perf_counter() - started
    cells = []
    batches = BATCHES if is_accelerator(device) else CPU_BATCHES
    for label, (width, height) in SIZES.items():
        images = [png(width, height, seed) for seed in range(max(batches))]
        first = functools.partial(model.preprocess, [images[0]], Modality.IMAGE)
        pre_s = _median_s(first, repeats, "cpu")
        batch = [model.preprocess([image], Modality.IMAGE) for image in images]
        tokens = batch[0].num_tokens
        for size in batches:
            forward_s = _median_s(functools.partial(model.forward, batch[:size]), repeats, device)
            cells.append(
                {
                    "image": label,
                    "batch": size,
                    "tokens_per_image": tokens,
                    "preprocess_ms_per_image": round(pre_s * 1e3, 2),
                    "forward_ms": round(forward_s * 1e3, 2),
                    "images_per_s": round(size / forward_s, 2),
                    "images_per_s_with_preprocess": round(size / (forward_s + size * pre_s), 2),
                }
            )
    figures = {
        "device": device,
        "device_name": device_name(device),
        "shape": shape,
        "build_s": round(build_s, 2),
        "repeats": repeats,
        "cells": cells,
    }
    if device.startswith("cuda"):
        import torch

        figures["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row("tower", "ok", seconds=time.perf_counter() - started, figures=figures)
