"""Batching: images per second of the tiny model at ``max_batch_size`` 1 vs 8.

Run as ``python benchmarks/bench_batching.py [--quick]``; writes ``batching.json`` and
``batching.png``.

An Encoder with the built-in ``"tiny"`` model (seeded Qwen2-VL architecture, real image
processor) encodes distinct PNG images (448x448: 256 tokens each) from 16 concurrent tasks,
each request one image, released right after its encode. Wall time from the first encode
to the last release gives images/s. The two batch sizes alternate, repeated; the median is
kept, and the ratio is taken from the medians. The forward batch sizes the batcher actually
formed are recorded through a thin wrapper around the model.

Preprocessing (PNG decode + Qwen2-VL image processor, ``preprocess_threads=2``) runs
outside the batch, so it bounds what batching can gain; the time spent in each phase is
reported too.
"""

from __future__ import annotations

import io
import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from _common import Options, headline, label_bars, parse_options, spread, write_json, write_png

CONCURRENCY = 16
BATCH_SIZES = (1, 8)
SIDE = 448


class _CountingModel:
    """Delegates to a real model and records forward batch sizes and times."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._lock = threading.Lock()
        self.batches: Counter[int] = Counter()
        self.forward_s = 0.0
        self.preprocess_s = 0.0

    @property
    def hidden_size(self) -> int:
        return int(self._model.hidden_size)

    @property
    def dtype(self) -> Any:
        return self._model.dtype

    def preprocess(self, items: Sequence[object], modality: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._model.preprocess(items, modality)
        finally:
            with self._lock:
                self.preprocess_s += time.perf_counter() - start

    def forward(self, batch: Sequence[Any]) -> Any:
        start = time.perf_counter()
        try:
            return self._model.forward(batch)
        finally:
            with self._lock:
                self.batches[len(batch)] += 1
                self.forward_s += time.perf_counter() - start

    def reset(self) -> None:
        self.batches.clear()
        self.forward_s = 0.0
        self.preprocess_s = 0.0


def _pngs(count: int) -> list[bytes]:
    import numpy as np
    from PIL import Image

    images = []
    for seed in range(count):
        pixels = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels, "RGB").save(buffer, "PNG")
        images.append(buffer.getvalue())
    return images


async def _run(model: _CountingModel, batch: int, images: list[bytes], tag: str) -> dict[str, Any]:
    import anyio

    from encdisagg import Encoder, EncoderConfig, EncodeRequest

    config = EncoderConfig(max_batch_size=batch, request_timeout_s=600.0)
    model.reset()
    queue = iter(enumerate(images))
    async with Encoder(config, model=model) as encoder:  # type: ignore[arg-type]

        async def worker() -> None:
            for index, image in queue:
                rid = f"{tag}-{index}"
                await encoder.encode(EncodeRequest(rid, [image]))
                await encoder.release(rid)

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for _ in range(CONCURRENCY):
                group.start_soon(worker)
        elapsed = time.perf_counter() - start
        assert encoder.stats().live_requests == 0
    forwards = sum(model.batches.values())
    return {
        "images_per_s": len(images) / elapsed,
        "elapsed_s": elapsed,
        "forward_batches": dict(sorted(model.batches.items())),
        "mean_batch": len(images) / forwards if forwards else 0.0,
        "forward_s": model.forward_s,
        "preprocess_thread_s": model.preprocess_s,
    }


def _plot(options: Options, data: dict[str, Any]) -> None:
    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        rows = data["runs"]
        labels = [f"max_batch_size={row['max_batch_size']}" for row in rows]
        bars = ax.bar(
            labels, [row["images_per_s"]["median"] for row in rows], color=["#999999", "#3b75af"]
        )
        label_bars(ax, bars, "{:.1f}")
        ax.set_ylabel("images/s (median of repeats)")
        ax.set_title(
            f"Tiny model, {SIDE}x{SIDE} images, {CONCURRENCY} concurrent requests: "
            f"{data['ratio_median']:.2f}x"
        )

    write_png(options, "batching", draw, size=(6.5, 4))


def main(argv: list[str] | None = None) -> int:
    import anyio

    from encdisagg.models import load_model

    options = parse_options(__doc__.splitlines()[0], argv)
    repeats = options.repeats or options.pick(3, 1)
    count = options.pick(128, 32)
    images = _pngs(count)
    model = _CountingModel(load_model("tiny"))
    # Warm-up: first calls allocate and pick kernels.
    anyio.run(_run, model, 8, images[:CONCURRENCY], "warm")
    results: dict[int, list[dict[str, Any]]] = {batch: [] for batch in BATCH_SIZES}
    for repeat in range(repeats):
        for batch in BATCH_SIZES:
            run = anyio.run(_run, model, batch, images, f"b{batch}-{repeat}")
            results[batch].append(run)
            print(
                f"max_batch_size={batch}: {run['images_per_s']:.1f} images/s, "
                f"batches {run['forward_batches']}"
            )
    rows = []
    for batch in BATCH_SIZES:
        runs = results[batch]
        rows.append(
            {
                "max_batch_size": batch,
                "images_per_s": spread([run["images_per_s"] for run in runs]),
                "mean_batch": statistics.median(run["mean_batch"] for run in runs),
                "forward_s_median": statistics.median(run["forward_s"] for run in runs),
                "preprocess_thread_s_median": statistics.median(
                    run["preprocess_thread_s"] for run in runs
                ),
                "runs": runs,
            }
        )
    ratio = rows[1]["images_per_s"]["median"] / rows[0]["images_per_s"]["median"]
    forward_ratio = rows[0]["forward_s_median"] / rows[1]["forward_s_median"]
    data = {
        "image": f"{SIDE}x{SIDE} PNG",
        "concurrency": CONCURRENCY,
        "images": count,
        "repeats": repeats,
        "runs": rows,
        "ratio_median": ratio,
        "forward_time_ratio_b1_over_b8": forward_ratio,
        "headline": [
            headline(
                "batching: images/s at max_batch_size 8 / 1",
                ratio,
                "x",
                note=(
                    f"{rows[1]['images_per_s']['median']:.1f} vs "
                    f"{rows[0]['images_per_s']['median']:.1f} images/s; forward time alone "
                    f"{forward_ratio:.2f}x less; mean batch {rows[1]['mean_batch']:.1f}"
                ),
            )
        ],
    }
    write_json(options, "batching", data)
    _plot(options, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
