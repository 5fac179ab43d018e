"""What the steps of ``gpu_check.py`` share: the row every step reports, device helpers,
generated images.

A row is a plain dict (it goes to JSON as is): ``step``, ``status`` (``ok``, ``failed`` or
``skipped``), ``reason`` (why it failed or was skipped; empty when ok), ``seconds`` (wall
time of the step) and ``figures`` (what it measured or checked).
"""

from __future__ import annotations

import io
import json
from typing import Any, Final, Literal

import numpy as np

Status = Literal["ok", "failed", "skipped"]
Row = dict[str, Any]

#: A step run in a child process prints its row on one line after this prefix.
ROW_PREFIX: Final = "gpu-check-row: "


def row(
    step: str,
    status: Status,
    *,
    reason: str = "",
    seconds: float = 0.0,
    figures: dict[str, Any] | None = None,
) -> Row:
    """One row of the table (and of the JSON)."""
    return {
        "step": step,
        "status": status,
        "reason": reason,
        "seconds": round(seconds, 2),
        "figures": figures or {},
    }


def print_row(result: Row) -> None:
    """Hand a child's row to the runner: one line, last on stdout."""
    print(ROW_PREFIX + json.dumps(result, default=str), flush=True)


def parse_row(stdout: str) -> Row | None:
    """The row a child printed (its last one), or None if it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(ROW_PREFIX):
            parsed: Row = json.loads(line[len(ROW_PREFIX) :])
            return parsed
    return None


def is_accelerator(device: str) -> bool:
    return device.partition(":")[0] != "cpu"


def synchronize(device: str) -> None:
    """Wait until the device finished its queued work (a no-op on the CPU): timings of an
    accelerator's forward must not stop while its kernels still run."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_name(device: str) -> str:
    """What the device is, in words (``NVIDIA H200``, ``cpu``)."""
    if device.startswith("cuda") and cuda_count():
        import torch

        return str(torch.cuda.get_device_name(torch.device(device)))
    return device


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels: real decoding and resizing, no file on disk."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG")
    return buffer.getvalue()
