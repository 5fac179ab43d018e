"""Preprocessing and forward time of the tiny models: one row per family, and the tiny sweep.

Run as ``python benchmarks/bench_models.py``; writes ``benchmarks/results/models.json``.

Rows (``rows``): every built-in tiny family on a typical input of its modality, on CPU, one
request of one item:

- images: a 448x448 PNG (``tiny`` Qwen2-VL, ``tiny-qwen2.5-vl``, ``tiny-kimi-k25``);
- videos: 8 frames of 448x448 PNG at 2 fps (``tiny``, ``tiny-qwen2.5-vl``);
- the families with row builders of their own, imported when present:
  ``_models_qwen3.py`` (``tiny-qwen3-vl``) and ``_models_audio.py`` (the tiny audio encoders
  on a 10 s clip).

``preprocess`` decodes the bytes and runs the model's real processor (and, for videos, the
timing arithmetic) in one thread, as one worker thread would; ``forward`` is one tower call.
Each figure is the median of several repeats after one warm-up; min, max and the process's
CPU time are kept too. torch runs one intra-op thread unless ``--threads`` says otherwise.

Sweep (``results``): the ``tiny`` model at 448x448 and 1280x720, batches of 1 and 8 requests.

To add a family: append a builder ``(repeats) -> list[row]`` to :data:`ROW_BUILDERS`, each
row made by :func:`row` (or a dict with the same keys).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image

from encdisagg._modality import Modality
from encdisagg.models import Preprocessed, load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = {"448x448": (448, 448), "1280x720": (1280, 720)}
BATCHES = (1, 8)
#: The typical inputs of the rows.
IMAGE_SIZE = (448, 448)
VIDEO_FRAMES = 8
VIDEO_FPS = 2.0

Row = dict[str, Any]
RowBuilder = Callable[[int], list[Row]]


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def _timed(action: Callable[[], object], repeats: int) -> dict[str, float]:
    action()  # warm-up: first calls allocate and pick kernels
    seconds = []
    cpu = []  # this process's CPU time (all its threads): less sensitive to a busy machine
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        action()
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "cpu_median_s": statistics.median(cpu),
        "repeats": repeats,
    }


def row(
    *,
    family: str,
    model: str,
    modality: str,
    input: str,
    grid: list[int],
    tokens: int,
    preprocess: dict[str, float],
    forward: dict[str, float],
    model_build_s: float | None = None,
    **extra: Any,
) -> Row:
    """One row of the per-family table (the schema every builder returns)."""
    return {
        "family": family,
        "model": model,
        "modality": modality,
        "input": input,
        "grid": grid,
        "tokens": tokens,
        "preprocess": preprocess,
        "forward": forward,
        "forward_tokens_per_s": tokens / forward["median_s"],
        "model_build_s": model_build_s,
        **extra,
    }


def _one_item_row(
    name: str, family: str, modality: Modality, item: object, label: str, repeats: int
) -> Row:
    start = time.perf_counter()
    model = load_model(name)
    build_s = time.perf_counter() - start
    pre = model.preprocess([item], modality)
    extra: dict[str, Any] = {}
    if pre.video_timing:
        timing = pre.video_timing[0]
        extra["second_per_grid_ts"] = timing.second_per_grid_ts
        extra["timestamps"] = list(timing.timestamps)
    return row(
        family=family,
        model=name,
        modality=modality.value,
        input=label,
        grid=list(pre.grid[0]),
        tokens=pre.num_tokens,
        preprocess=_timed(functools.partial(model.preprocess, [item], modality), repeats),
        forward=_timed(functools.partial(model.forward, [pre]), repeats),
        model_build_s=build_s,
        hidden_size=model.hidden_size,
        **extra,
    )


_QWEN_FAMILIES = (("tiny", "qwen2_vl"), ("tiny-qwen2.5-vl", "qwen2_5_vl"))


def qwen_vl_rows(repeats: int) -> list[Row]:
    """The Qwen2-VL and Qwen2.5-VL rows: a 448x448 image and an 8-frame video each."""
    width, height = IMAGE_SIZE
    image = _png(width, height, seed=0)
    video = {
        "frames": [_png(width, height, seed=1 + n) for n in range(VIDEO_FRAMES)],
        "fps": VIDEO_FPS,
    }
    rows = []
    for name, family in _QWEN_FAMILIES:
        rows.append(
            _one_item_row(name, family, Modality.IMAGE, image, f"{width}x{height} PNG", repeats)
        )
        label = f"{VIDEO_FRAMES} frames {width}x{height} PNG, {VIDEO_FPS:g} fps"
        rows.append(_one_item_row(name, family, Modality.VIDEO, video, label, repeats))
    return rows


def kimi_rows(repeats: int) -> list[Row]:
    """The Kimi-K2.5 row: a 448x448 image."""
    width, height = IMAGE_SIZE
    image = _png(width, height, seed=0)
    label = f"{width}x{height} PNG"
    return [_one_item_row("tiny-kimi-k25", "kimi_k25", Modality.IMAGE, image, label, repeats)]


def _seconds(milliseconds: float, repeats: int) -> dict[str, float]:
    return {"median_s": milliseconds / 1e3, "repeats": repeats}


def qwen3_rows(repeats: int) -> list[Row]:
    """``_models_qwen3.bench_qwen3_vl`` (one dict, times in ms) in the common schema."""
    found = importlib.import_module("_models_qwen3").bench_qwen3_vl(repeats)
    kept = {key: value for key, value in found.items() if not key.endswith("_ms")}
    kept.pop("repeats", None)
    return [
        row(
            **kept,
            preprocess=_seconds(found["preprocess_ms"], repeats),
            forward=_seconds(found["forward_ms"], repeats),
        )
    ]


def audio_rows(repeats: int) -> list[Row]:
    """``_models_audio.audio_rows`` (batches of 1 and 8), the one-clip rows of each model."""
    found = importlib.import_module("_models_audio").audio_rows(repeats)
    return [
        row(**{key: value for key, value in item.items() if key != "forward_tokens_per_s"})
        for item in found
        if item.get("batch", 1) == 1
    ]


def _optional(module: str, builder: RowBuilder) -> list[RowBuilder]:
    """``[builder]`` if ``benchmarks/<module>.py`` exists (another family's own file)."""
    return [builder] if (Path(__file__).resolve().parent / f"{module}.py").is_file() else []


#: One builder per family (or group of families); each returns its rows.
ROW_BUILDERS: list[RowBuilder] = [
    qwen_vl_rows,
    kimi_rows,
    *_optional("_models_qwen3", qwen3_rows),
    *_optional("_models_audio", audio_rows),
]


def _preprocess_each(model: Any, items: list[bytes]) -> list[Preprocessed]:
    return [model.preprocess([item], Modality.IMAGE) for item in items]


def sweep(repeats: int) -> list[Row]:
    """The ``tiny`` model per image size and batch size."""
    model = load_model("tiny")
    results: list[Row] = []
    for label, (width, height) in SIZES.items():
        pngs = [_png(width, height, seed) for seed in range(max(BATCHES))]
        for batch in BATCHES:
            items = pngs[:batch]
            preprocessed = _preprocess_each(model, items)
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
    return results


def _ms(timing: dict[str, float]) -> float:
    return timing["median_s"] * 1e3


def _spread(timing: dict[str, float]) -> str:
    # The median, and the fastest repeat where the builder kept it: on a shared machine the
    # fastest is the closer to what the code costs.
    if "min_s" in timing:
        return f"{_ms(timing):.1f} ms (min {timing['min_s'] * 1e3:.1f})"
    return f"{_ms(timing):.1f} ms"


def _cpu(item: Row) -> str:
    # Both steps' CPU time, all threads: what the work costs, whatever else the machine does.
    parts = [item[step].get("cpu_median_s") for step in ("preprocess", "forward")]
    if None in parts:
        return ""
    return f"{sum(parts) * 1e3:.1f} ms"


def table(rows: list[Row]) -> str:
    """The rows as a markdown table (as docs/benchmarks.md shows them): medians, and the
    fastest repeat in brackets."""
    lines = [
        "| family | model | modality | input | grid | tokens | preprocess | forward | CPU time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines.extend(
        f"| {item['family']} | `{item['model']}` | {item['modality']} | {item['input']} | "
        f"{item['grid']} | {item['tokens']} | {_spread(item['preprocess'])} | "
        f"{_spread(item['forward'])} | {_cpu(item)} |"
        for item in rows
    )
    return "\n".join(lines)


def headlines(rows: list[Row], results: list[Row]) -> list[dict[str, Any]]:
    """The summary table's rows: the tiny sweep at batch 1, then one per family row."""
    found = [
        {
            "figure": f"tiny model {result['image']}: preprocess + forward",
            "value": _ms(result["preprocess"]) + _ms(result["forward"]),
            "unit": "ms",
            "goal": None,
            "met": None,
            "note": (
                f"preprocess {_ms(result['preprocess']):.0f} ms, forward "
                f"{_ms(result['forward']):.0f} ms, {result['tokens']} tokens"
            ),
        }
        for result in results
        if result["batch"] == 1
    ]
    found.extend(
        {
            "figure": f"{item['model']} {item['modality']} ({item['input']}): preprocess + forward",
            "value": _ms(item["preprocess"]) + _ms(item["forward"]),
            "unit": "ms",
            "goal": None,
            "met": None,
            "note": (
                f"preprocess {_spread(item['preprocess'])}, forward "
                f"{_spread(item['forward'])}, {item['tokens']} tokens"
            ),
        }
        for item in rows
    )
    return found


def run(repeats: int) -> dict[str, object]:
    load_before = os.getloadavg()
    rows: list[Row] = []
    for builder in ROW_BUILDERS:
        built = builder(repeats)
        rows.extend(built)
        print(table(built).split("\n", 2)[-1])
    results = sweep(repeats)
    return {
        "dtype": "float32",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        # 1-minute load averages when the run started and ended: other work on the machine.
        "load_average": [load_before[0], os.getloadavg()[0]],
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": rows,
        "model": "tiny",
        "results": results,
        "headline": headlines(rows, results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared machine, more threads measure "
        "the contention more than the model; 0 keeps torch's own choice)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "models.json",
    )
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    report = run(args.repeats)
    print(table(report["rows"]))  # type: ignore[arg-type]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
