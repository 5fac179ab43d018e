"""``encdisagg loadgen URL…``: a bounded load against running encoders, summarised.

Each request encodes generated PNG images through :class:`EncoderClient` (so its parts spread
as a prefill's would) and releases them; ``--concurrency`` requests run at once. Latency is
read from the wall clock: this is a measuring tool, not logic.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import anyio
import numpy as np
from PIL import Image

from .._errors import EncdisaggError
from ..pipeline._demo_types import ProgressBar
from ..receiver import EncoderClient

__all__ = ["LoadResult", "run_loadgen"]


@dataclass
class LoadResult:
    """What a load run saw: latencies of the requests that succeeded, failures by status."""

    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[int] = field(default_factory=Counter)
    elapsed_s: float = 0.0

    def percentile(self, share: float) -> float:
        """The latency under which ``share`` of the successful requests finished (nearest
        rank); ``nan`` with none."""
        if not self.latencies_s:
            return math.nan
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]

    def summary(self) -> dict[str, object]:
        done = len(self.latencies_s)
        return {
            "requests": done + sum(self.errors.values()),
            "ok": done,
            "errors": {str(status): count for status, count in sorted(self.errors.items())},
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": round(done / self.elapsed_s, 2) if self.elapsed_s else 0.0,
            **{
                f"p{round(share * 100)}_ms": round(self.percentile(share) * 1000, 2)
                for share in (0.5, 0.9, 0.99)
            },
        }


def images_for(args: argparse.Namespace) -> list[list[bytes]]:
    """Each request's PNG images: distinct noise, except a ``--repeat`` share drawn from
    the images made before (so the encoders' caches can answer them)."""
    rng = random.Random(args.seed)
    width, height = args.size
    made: list[bytes] = []
    requests: list[list[bytes]] = []
    for _ in range(args.requests):
        items = []
        for _ in range(args.images):
            if made and rng.random() < args.repeat:
                items.append(rng.choice(made))
                continue
            pixels = np.random.default_rng(rng.getrandbits(32)).integers(
                0, 256, (height, width, 3), dtype=np.uint8
            )
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
            made.append(buffer.getvalue())
            items.append(made[-1])
        requests.append(items)
    return requests


async def run_load(
    args: argparse.Namespace, requests: list[list[bytes]], progress: ProgressBar
) -> LoadResult:
    """Run every request, ``args.concurrency`` at a time. A checkpoint; cancelling it
    cancels the requests in flight (their parts are released by the client)."""
    result = LoadResult()
    limiter = anyio.CapacityLimiter(args.concurrency)
    started = time.perf_counter()
    async with EncoderClient(
        args.urls,
        encode_timeout_s=args.timeout_s,
        release_timeout_s=min(args.timeout_s, 5.0),
        max_connections=max(args.concurrency, 1) * 2,
        api_key=args.api_key,
    ) as client:

        async def one(number: int, items: list[bytes]) -> None:
            async with limiter:
                begun = time.perf_counter()
                plan = client.plan(f"loadgen-{args.seed}-{number}", {"image": items})
                try:
                    await client.encode(plan)
                except EncdisaggError as exc:
                    result.errors[exc.status] += 1
                    progress.advance(str(exc.status))
                    return
                await client.release(plan.parts)
                result.latencies_s.append(time.perf_counter() - begun)
                progress.advance("ok")

        async with anyio.create_task_group() as group:
            for number, items in enumerate(requests):
                group.start_soon(one, number, items)
    result.elapsed_s = time.perf_counter() - started
    return result


def run_loadgen(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """The command: 0 if every request succeeded, 1 otherwise."""
    out = out or sys.stdout
    requests = images_for(args)
    progress = ProgressBar(len(requests), stream=sys.stderr)
    try:
        result = anyio.run(run_load, args, requests, progress, backend=args.backend)
    except KeyboardInterrupt:
        return 1
    finally:
        progress.finish()
    summary = result.summary()
    if args.json:
        print(json.dumps(summary), file=out)
    else:
        errors = " ".join(f"{code}={count}" for code, count in sorted(result.errors.items()))
        print(
            f"requests={summary['requests']} ok={summary['ok']} errors={errors or 0} "
            f"rate={summary['requests_per_s']}/s p50={summary['p50_ms']}ms "
            f"p90={summary['p90_ms']}ms p99={summary['p99_ms']}ms",
            file=out,
        )
    if args.plot:
        Path(args.plot).write_text(latency_svg(result.latencies_s))
        print(f"latency histogram written to {args.plot}", file=out)
    return 0 if not result.errors else 1


def latency_svg(latencies_s: list[float], *, bins: int = 30) -> str:
    """A self-contained SVG histogram of the latencies in milliseconds."""
    width, height, margin = 640, 320, 40
    values = [seconds * 1000 for seconds in latencies_s] or [0.0]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, int((value - low) / span * bins))] += 1
    tallest = max(counts) or 1
    bar = (width - 2 * margin) / bins
    rects = []
    for index, count in enumerate(counts):
        tall = count / tallest * (height - 2 * margin)
        x, y = margin + index * bar, height - margin - tall
        rects.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar - 1:.1f}" height="{tall:.1f}" '
            'fill="#4a7bd0"/>'
        )
    font = 'font-family="sans-serif" font-size="11"'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<text x="{margin}" y="20" {font}>latency of {len(latencies_s)} requests (ms)</text>'
        + "".join(rects)
        + f'<text x="{margin}" y="{height - 12}" {font}>{low:.1f}</text>'
        f'<text x="{width - margin}" y="{height - 12}" {font} text-anchor="end">{high:.1f}</text>'
        "</svg>"
    )
