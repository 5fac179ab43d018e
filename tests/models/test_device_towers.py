"""The Qwen towers on the tests' device (``ENCDISAGG_TEST_DEVICE``, the CPU by default), in
float32 and bfloat16: a fused batch encodes each request as it does alone, the embeddings
stay on the device in the tower's dtype, and float32 agrees with the CPU."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from encdisagg import Modality
from encdisagg.models import load_model

from .._device import chosen_device

pytestmark = pytest.mark.device

SIZES = ((56, 56), (112, 84), (168, 112))


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in float32 on the host: one bound for every dtype and device,
    where kernels may sum in another order (TF32 convolutions, fused batch shapes)."""
    got, want = got.float().cpu(), want.float().cpu()
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2.5-vl"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fused_batch_on_the_device_encodes_each_request_as_alone(name: str, dtype: str) -> None:
    device = chosen_device()
    model = load_model(name, device=str(device), dtype=dtype)
    requests = [
        model.preprocess([png(width, height, seed)], Modality.IMAGE)
        for seed, (width, height) in enumerate(SIZES)
    ]
    fused = model.forward(requests)
    alone = [model.forward([request])[0] for request in requests]
    for request, rows, single in zip(requests, fused, alone, strict=True):
        assert rows.device.type == device.type
        assert rows.dtype == getattr(torch, dtype)
        assert rows.shape == (request.num_tokens, model.hidden_size)
        assert relative_error(rows, single) < (1e-4 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2.5-vl"])
def test_float32_on_the_device_agrees_with_the_cpu(name: str) -> None:
    device = chosen_device()
    on_device = load_model(name, device=str(device))
    on_cpu = load_model(name)
    request = on_cpu.preprocess([png(112, 84, 7)], Modality.IMAGE)
    want = on_cpu.forward([request])[0]
    got = on_device.forward([request])[0]
    # Exact on the CPU; an accelerator may use TF32 convolutions.
    assert relative_error(got, want) < (1e-6 if device.type == "cpu" else 1e-2)
