"""Image preprocessing throughput: the processor, ours (fast, reference, device), decoding.

Run as ``python benchmarks/bench_preprocess.py``; writes ``benchmarks/results/preprocess.json``.

For the tiny Qwen2-VL (``tiny``) and Qwen3-VL (``tiny-qwen3-vl``) models and three inputs (a
448x448 PNG, a 1280x720 and a 1920x1080 JPEG, photo-like: smooth gradients, grain, a blur),
four ways to turn the encoded bytes into what the tower reads are timed, one image at a time:

- ``hf``: decode with Pillow, then ``Qwen2VLImageProcessorPil`` with the model's settings;
- ``fast``: ``model.preprocess`` on the default ``preprocess = "fast"`` path;
- ``reference``: ``model.preprocess`` with ``preprocess = "reference"`` (the processor itself);
- ``decode``: Pillow's decoding alone, the floor every path pays;
- ``device`` (only where CUDA is available; the JSON notes its absence otherwise):
  ``preprocess = "device"`` with the model on ``cuda``, the same kernels run there from one
  pinned ``uint8`` upload; each call waits for the device.

``model.preprocess`` also checks the budgets and computes the cache key, as a server does.
The four run in alternating rounds (one call of each per round, in a rotating order), so a
neighbour's load hits them alike; each ratio is the median over rounds of the per-round
ratio. torch runs one intra-op thread: the figures are per core.

Threads: the fast path on the 1280x720 JPEG, the same images preprocessed by one thread and
by two threads at once (two workers of an encoder), alternating; images/s of each and the
median per-round ratio. Two threads only scale where the work releases the GIL.
"""

from __future__ import annotations

import io
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image, ImageFilter
from transformers import Qwen2VLImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import headline, parse_options, write_json

from encdisagg._modality import Modality
from encdisagg.models import load_model, qwen3_vl_image_processor

MODELS: dict[str, Callable[[], Qwen2VLImageProcessorPil]] = {
    "tiny": Qwen2VLImageProcessorPil,
    "tiny-qwen3-vl": qwen3_vl_image_processor,
}
INPUTS = (("448x448 PNG", 448, 448, "PNG"), ("1280x720 JPEG", 1280, 720, "JPEG"))
INPUTS += (("1920x1080 JPEG", 1920, 1080, "JPEG"),)
#: Where the ``device`` way runs, if anywhere.
DEVICE = "cuda" if torch.cuda.is_available() else None
WAYS = ("hf", "fast", "reference", "decode") + (("device",) if DEVICE else ())
NO_DEVICE = "skipped: no CUDA device (its figures come only from a machine with one)"
#: Goals of the fast path: times the processor's throughput, per input.
SPEEDUP_GOALS = {"448x448 PNG": 1.5, "1280x720 JPEG": 4.0, "1920x1080 JPEG": 4.0}
DECODE_GOAL = 3.0  # the fast path within this many times decoding alone
THREADS_GOAL = 1.7


def photo(width: int, height: int, fmt: str, seed: int = 0) -> bytes:
    """A photo-like image (gradients, grain, a slight blur), encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = (base + rng.normal(0, 20, (height, width, 3))).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB").filter(ImageFilter.GaussianBlur(1.5))
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def decode(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def _ways(name: str, data: bytes) -> dict[str, Callable[[], object]]:
    fast = load_model(name)
    reference = load_model(name, preprocess="reference")
    assert fast.preprocess_mode == "fast"
    assert reference.preprocess_mode == "reference"
    processor = MODELS[name]()
    ways: dict[str, Callable[[], object]] = {
        "hf": lambda: processor(images=[decode(data)], return_tensors="pt"),
        "fast": lambda: fast.preprocess([data], Modality.IMAGE),
        "reference": lambda: reference.preprocess([data], Modality.IMAGE),
        "decode": lambda: decode(data),
    }
    if DEVICE is not None:
        on_device = load_model(name, device=DEVICE, preprocess="device")
        assert on_device.preprocess_mode == "device"

        def device_way() -> object:
            pre = on_device.preprocess([data], Modality.IMAGE)
            torch.cuda.synchronize()  # the pixel values are made, not only queued
            return pre

        ways["device"] = device_way
    return ways


def alternating(ways: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each way per round; one call of each per round, the order rotating."""
    names = list(ways)
    for action in ways.values():
        action()  # warm-up: first calls allocate and pick kernels
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for number in range(rounds):
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            ways[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def _ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def measure(name: str, label: str, data: bytes, rounds: int) -> dict[str, Any]:
    seconds = alternating(_ways(name, data), rounds)
    row: dict[str, Any] = {"model": name, "input": label, "bytes": len(data), "rounds": rounds}
    for way in WAYS:
        median = statistics.median(seconds[way])
        row[way] = {
            "median_ms": median * 1e3,
            "min_ms": min(seconds[way]) * 1e3,
            "images_per_s": 1.0 / median,
        }
    row["fast_vs_hf"] = _ratio(seconds["hf"], seconds["fast"])
    row["reference_vs_hf"] = _ratio(seconds["hf"], seconds["reference"])
    row["fast_vs_decode"] = _ratio(seconds["fast"], seconds["decode"])
    if DEVICE is None:
        row["device"] = NO_DEVICE
    else:
        row["device_vs_fast"] = _ratio(seconds["fast"], seconds["device"])
    return row


def threads(name: str, data: bytes, images: int, rounds: int) -> dict[str, Any]:
    """Images/s of the fast path with one thread and with two, alternating."""
    model = load_model(name)
    model.preprocess([data], Modality.IMAGE)

    def work(count: int) -> None:
        for _ in range(count):
            model.preprocess([data], Modality.IMAGE)

    one: list[float] = []
    two: list[float] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(work, [1, 1]))  # warm both workers
        for number in range(rounds):
            for width in (1, 2) if number % 2 == 0 else (2, 1):
                start = time.perf_counter()
                if width == 1:
                    work(images)
                else:
                    list(pool.map(work, [images // 2, images - images // 2]))
                rate = images / (time.perf_counter() - start)
                (one if width == 1 else two).append(rate)
    return {
        "model": name,
        "input": "1280x720 JPEG",
        "images_per_round": images,
        "rounds": rounds,
        "one_thread_images_per_s": statistics.median(one),
        "two_threads_images_per_s": statistics.median(two),
        "ratio": _ratio(two, one),
    }


def headlines(rows: list[dict[str, Any]], scaling: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for row in rows:
        goal = SPEEDUP_GOALS[row["input"]]
        found.append(
            headline(
                f"{row['model']} {row['input']}: fast preprocess vs HF processor",
                row["fast_vs_hf"],
                "x",
                goal=f">= {goal}x",
                met=row["fast_vs_hf"] >= goal,
                note=(
                    f"fast {row['fast']['images_per_s']:.0f}/s, HF "
                    f"{row['hf']['images_per_s']:.0f}/s, reference "
                    f"{row['reference']['images_per_s']:.0f}/s, decode only "
                    f"{row['decode']['images_per_s']:.0f}/s per core; fast = "
                    f"{row['fast_vs_decode']:.1f}x decode (goal <= {DECODE_GOAL}x)"
                ),
            )
        )
        if DEVICE is not None:
            found.append(
                headline(
                    f"{row['model']} {row['input']}: device preprocess vs fast (CPU)",
                    row["device_vs_fast"],
                    "x",
                    note=f"device {row['device']['images_per_s']:.0f}/s on {DEVICE}",
                )
            )
    found.append(
        headline(
            f"{scaling['model']} {scaling['input']}: fast preprocess, 2 threads vs 1",
            scaling["ratio"],
            "x",
            goal=f">= {THREADS_GOAL}x",
            met=scaling["ratio"] >= THREADS_GOAL,
            note=(
                f"{scaling['one_thread_images_per_s']:.0f}/s with one thread, "
                f"{scaling['two_threads_images_per_s']:.0f}/s with two"
            ),
        )
    )
    return found


def main() -> None:
    options = parse_options(__doc__.splitlines()[0])
    torch.set_num_threads(1)  # per core; worker threads bring their own core
    rounds = options.repeats or options.pick(40, 6)
    load_before = os.getloadavg()
    rows = []
    for name in MODELS:
        for label, width, height, fmt in INPUTS:
            row = measure(name, label, photo(width, height, fmt), rounds)
            rows.append(row)
            print(
                f"{name:14} {label:15} hf {row['hf']['median_ms']:6.1f} ms  fast "
                f"{row['fast']['median_ms']:6.1f} ms  reference "
                f"{row['reference']['median_ms']:6.1f} ms  decode "
                f"{row['decode']['median_ms']:5.1f} ms  fast/hf {row['fast_vs_hf']:.2f}x  "
                f"fast/decode {row['fast_vs_decode']:.2f}x"
                + (
                    f"  device {row['device']['median_ms']:6.1f} ms"
                    if DEVICE
                    else "  device skipped"
                )
            )
    if DEVICE is None:
        print(f"the device way: {NO_DEVICE}")
    scaling = threads("tiny", photo(1280, 720, "JPEG"), options.pick(16, 4), options.pick(10, 2))
    print(f"2 threads vs 1: {scaling['ratio']:.2f}x")
    write_json(
        options,
        "preprocess",
        {
            "torch_threads": 1,
            # 1-minute load averages when the run started and ended: other work on the machine.
            "load_average": [load_before[0], os.getloadavg()[0]],
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": DEVICE or NO_DEVICE,
            "rows": rows,
            "threads": scaling,
            "headline": headlines(rows, scaling),
        },
    )


if __name__ == "__main__":
    main()
