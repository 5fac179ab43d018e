"""E->P->D vs colocated: time to first token and time per output token on the demo pipeline.

Run as ``python benchmarks/bench_epd.py [--quick]``; writes ``epd.json`` and ``epd.png``.

*Disaggregated*: :func:`encdisagg.pipeline.run_demo` (the pipeline behind ``encdisagg demo``):
two encoder servers over HTTP, a prefill and a decode worker with their own copies of the
tiny Qwen2-VL, embeddings over ZMQ (or Mooncake TCP) and KV over transfer engines, all in
one process on one event loop. Its TTFT runs from the decode side's admission of a request
to its first token; TPOT is the mean gap between the following tokens.

*Colocated*: the same requests (same images, prompts and token budget, taken from the
demo's own plan) on one copy of the same model: decode the image from its data URL,
preprocess it as the encoders do (the fast path, so both sides see the same pixels), and
``generate`` greedily with its own vision tower; a streamer
stamps each token. With concurrency above one, requests share the model one at a time
(as a server without batching would); TTFT then includes waiting for it.

Both run at concurrency 1, 4 and 16 on small (the demo's 56-112 px) and larger (224-448 px)
images with 16 tokens per request, and on small images with 128: with 16 a request decodes
faster than the encoders and prefill deliver the next, so batches seldom form; with 128
requests overlap in decode, and the decode throughput's growth with concurrency is a
headline. The generated tokens are compared: both sides must produce the same tokens. The decode
worker batches every running request into one step over paged KV; its throughput is reported
as tokens per second of step time (and the mean batch), beside the colocated model's tokens
per second of ``generate`` time.

Each side runs as it runs best on this machine: the pipeline's compute threads (two encoders,
prefill, decode) with one torch intra-op thread each (with torch's default, each of them
spreads its matrix products over both cores and they crowd each other out, the decode steps
worst); the colocated run, a single compute thread, with torch's default.

After the timed runs, each concurrency-1 cell of 16 tokens runs once more with an in-memory
OpenTelemetry exporter: the pipeline's own spans cut each request's TTFT into stages
(``_epd_stages.py``: admission, the ``/encode`` call, preprocessing, the forward, staging,
the ``/send`` call, the push, prefill, the KV write, the first decode step) that add up to
it exactly, reported beside the colocated request's stages (image decode, processor,
``generate`` to the first token).

On one machine with two cores there is no extra hardware for disaggregation to use, so its
costs (HTTP, transfers, three model copies competing for the same cores) are not paid back
here. The figures show what the pipeline costs, not what it gains on a real cluster.
"""

from __future__ import annotations

import base64
import io
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from _common import Options, headline, parse_options, write_json, write_png
from _epd_stages import (
    COLOCATED_STAGES,
    STAGES,
    colocated_stages,
    in_memory_tracing,
    traced_stages,
)

NEW_TOKENS = 16
#: Tokens per request of the long-generation cells.
LONG_NEW_TOKENS = 128
#: The pipeline runs its compute threads (two encoders, prefill, decode) with one intra-op
#: thread each; the colocated run, one compute thread, keeps torch's default.
DISAGGREGATED_TORCH_THREADS = 1


def _scenarios(options: Options) -> list[dict[str, Any]]:
    small = {"image_min_side": 56, "image_max_side": 112}
    large = {"image_min_side": 224, "image_max_side": 448}
    cells = [
        {"name": "small images, c=1", "concurrency": 1, "transfer": "zmq", **small},
        {"name": "small images, c=4", "concurrency": 4, "transfer": "zmq", **small},
        {"name": "small images, c=16", "concurrency": 16, "transfer": "zmq", **small},
        {"name": "larger images, c=1", "concurrency": 1, "transfer": "zmq", **large},
        {"name": "larger images, c=4", "concurrency": 4, "transfer": "zmq", **large},
        {"name": "larger images, c=16", "concurrency": 16, "transfer": "zmq", **large},
    ]
    # Long generations: a request then decodes for longer than the encoders and prefill take to
    # deliver the next, so requests overlap in decode and batches form.
    cells += [
        {
            "name": f"small images, {LONG_NEW_TOKENS} tokens, c={c}",
            "concurrency": c,
            "transfer": "zmq",
            "new_tokens": LONG_NEW_TOKENS,
            **small,
        }
        for c in (1, 4, 16)
    ]
    if not options.quick:
        cells.append(
            {
                "name": "small images, c=1, Mooncake",
                "concurrency": 1,
                "transfer": "mooncake",
                **small,
            }
        )
    for cell in cells:
        # Two rounds of the concurrency at least, so the batch fills and drains.
        cell["requests"] = max(options.pick(16, 4), 2 * cell["concurrency"])
    return cells


def _options(cell: dict[str, Any]) -> Any:
    from encdisagg.pipeline import DemoOptions

    return DemoOptions(
        requests=cell["requests"],
        transfer=cell["transfer"],
        concurrency=cell["concurrency"],
        new_tokens=cell.get("new_tokens", NEW_TOKENS),
        image_min_side=cell["image_min_side"],
        image_max_side=cell["image_max_side"],
        torch_threads=DISAGGREGATED_TORCH_THREADS,
        verbose=False,
    )


async def _disaggregated(cell: dict[str, Any]) -> dict[str, Any]:
    from encdisagg.pipeline import run_demo

    report = await run_demo(_options(cell), out=io.StringIO(), err=io.StringIO())
    outcomes = {
        o.rid: {"ttft_s": o.ttft_s, "tpot_s": o.tpot_s, "tokens": list(o.tokens)}
        for o in report.outcomes
    }
    stats = report.decode
    return {
        "ok": report.ok,
        "elapsed_s": report.elapsed_s,
        "requests": outcomes,
        # The decode worker's throughput while it steps: tokens per second of step time.
        "decode_tokens_per_s": stats.step_tokens / stats.step_seconds
        if stats.step_seconds
        else float("nan"),
        "mean_batch": stats.step_tokens / stats.decode_steps if stats.decode_steps else 0.0,
    }


class _Clock:
    """A ``generate`` streamer that stamps every generated token (the first ``put`` is the
    prompt)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.stamps: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.stamps.append(time.perf_counter())
        self.tokens.extend(int(t) for t in value.reshape(-1))

    def end(self) -> None:
        pass


def _colocated_one(
    lm: Any,
    vision: Any,
    lock: threading.Lock,
    prompt: str,
    urls: Sequence[str],
    new_tokens: int,
) -> Any:
    import torch
    from PIL import Image

    from encdisagg import Modality

    start = time.perf_counter()
    images = []
    for url in urls:
        data = base64.b64decode(url.split(",", 1)[1])
        images.append(Image.open(io.BytesIO(data)).convert("RGB"))
    decoded = time.perf_counter()
    # The encoders' own preprocessing (the fast path): both sides see the same pixels.
    features = vision.preprocess(images, Modality.IMAGE).features
    pixels = {"pixel_values": features["pixel_values"], "image_grid_thw": features["grid_thw"]}
    processed = time.perf_counter()
    merge = int(lm.model.config.vision_config.spatial_merge_size)
    counts = [int(row.prod()) // (merge * merge) for row in pixels["image_grid_thw"]]
    ids = torch.tensor([lm.prompt_ids(prompt, counts)], dtype=torch.long)
    clock = _Clock()
    with lock, torch.inference_mode():
        lm.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == lm.image_token_id).int(),
            max_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
        )
    ttft = clock.stamps[0] - start
    decode_s = clock.stamps[-1] - clock.stamps[0]
    tpot = None
    if len(clock.stamps) > 1:
        tpot = (clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1)
    stages = dict(
        zip(
            COLOCATED_STAGES,
            (decoded - start, processed - decoded, clock.stamps[0] - processed),
            strict=True,
        )
    )
    return {
        "ttft_s": ttft,
        "tpot_s": tpot,
        "tokens": clock.tokens,
        "decode_s": decode_s,
        "stages": stages,
    }


async def _colocated(cell: dict[str, Any], lm: Any, vision: Any) -> dict[str, Any]:
    import anyio
    import anyio.to_thread

    # The demo's own plan: the same images, prompts and order as the disaggregated run.
    from encdisagg.pipeline._demo import _plan

    planned = _plan(_options(cell))
    lock = threading.Lock()
    limiter = anyio.CapacityLimiter(cell["concurrency"])
    threads = anyio.CapacityLimiter(cell["concurrency"])
    results: dict[str, Any] = {}

    async def one(item: Any) -> None:
        async with limiter:
            request = item.request
            results[request.rid] = await anyio.to_thread.run_sync(
                _colocated_one,
                lm,
                vision,
                lock,
                request.prompt,
                request.images,
                cell.get("new_tokens", NEW_TOKENS),
                limiter=threads,
            )

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for item in planned:
            group.start_soon(one, item)
    # One request decodes at a time: tokens after the first over the time spent on them.
    decoded = sum(len(r["tokens"]) - 1 for r in results.values())
    busy = sum(r["decode_s"] for r in results.values())
    return {
        "elapsed_s": time.perf_counter() - start,
        "requests": results,
        "decode_tokens_per_s": decoded / busy if busy else float("nan"),
    }


def _summary(requests: dict[str, Any]) -> dict[str, float]:
    ttft = [r["ttft_s"] for r in requests.values() if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in requests.values() if r["tpot_s"] is not None]
    return {
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
        "tpot_p50_ms": statistics.median(tpot) * 1e3,
        "tpot_mean_ms": statistics.fmean(tpot) * 1e3,
    }


def _plot(options: Options, rows: list[dict[str, Any]]) -> None:
    def draw(fig: Any) -> None:
        for index, (metric, title) in enumerate(
            (("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"))
        ):
            ax = fig.add_subplot(1, 2, index + 1)
            xs = list(range(len(rows)))
            width = 0.38
            ax.bar(
                [x - width / 2 for x in xs],
                [row["colocated"][metric] for row in rows],
                width,
                color="#999999",
                label="colocated",
            )
            ax.bar(
                [x + width / 2 for x in xs],
                [row["disaggregated"][metric] for row in rows],
                width,
                color="#3b75af",
                label="E->P->D",
            )
            for x, row in zip(xs, rows, strict=True):
                ratio = row["disaggregated"][metric] / row["colocated"][metric]
                ax.annotate(
                    f"{ratio:.1f}x",
                    (x + width / 2, row["disaggregated"][metric]),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
            ax.set_xticks(xs, [row["name"].replace(", ", "\n") for row in rows], fontsize=7)
            ax.set_ylabel(title)
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        fig.suptitle("Tiny Qwen2-VL on one 2-core machine: E->P->D vs colocated (lower is better)")

    write_png(options, "epd", draw, size=(11, 4.5))


def _add_breakdowns(rows: list[dict[str, Any]], colocated: dict[str, list[dict[str, Any]]]) -> None:
    """Give each concurrency-1 row of 16 tokens its per-stage breakdown (see ``_epd_stages``):
    one traced run of the pipeline after every timed run is done (a tracer provider, once set,
    stays), beside the colocated stages of the timed runs."""
    import anyio

    try:
        exporter = in_memory_tracing()
    except ImportError:
        print("no breakdown: the OpenTelemetry SDK is not installed (the otel extra)")
        return
    for row in rows:
        if row["concurrency"] != 1 or row.get("new_tokens", NEW_TOKENS) != NEW_TOKENS:
            continue
        exporter.clear()
        run = anyio.run(_disaggregated, row)
        ttft = {rid: r["ttft_s"] for rid, r in run["requests"].items()}
        pooled = {
            f"{index}/{rid}": request
            for index, repeat in enumerate(colocated[row["name"]])
            for rid, request in repeat["requests"].items()
        }
        row["stages"] = {
            "traced_ttft_p50_ms": statistics.median(ttft.values()) * 1e3,
            "disaggregated_ms": traced_stages(exporter.get_finished_spans(), ttft),
            "colocated_ms": colocated_stages(pooled),
        }
        print(
            f"{row['name']}: stages, p50 ms (traced TTFT {row['stages']['traced_ttft_p50_ms']:.1f})"
        )
        for stage in STAGES:
            print(f"  {stage:>40} {row['stages']['disaggregated_ms'][stage]:7.2f}")
        for stage in COLOCATED_STAGES:
            print(f"  {'colocated: ' + stage:>40} {row['stages']['colocated_ms'][stage]:7.2f}")


#: The issue's goal for the time per output token against colocated, where requests overlap.
TPOT_GOAL = 1.5


def headlines(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary rows: TPOT against colocated per cell (with the goal at concurrency 4 and
    16), then TTFT."""
    heads = []
    for row in rows:
        goal = row["concurrency"] >= 4
        heads.append(
            headline(
                f"E->P->D / colocated TPOT p50, {row['name']}",
                row["tpot_ratio"],
                "x",
                goal=f"<= {TPOT_GOAL}x" if goal else None,
                met=row["tpot_ratio"] <= TPOT_GOAL if goal else None,
                note=(
                    f"TPOT {row['disaggregated']['tpot_p50_ms']:.2f} vs "
                    f"{row['colocated']['tpot_p50_ms']:.2f} ms; decode "
                    f"{row['disaggregated_decode_tokens_per_s']:.0f} tok/s while stepping (mean "
                    f"batch {row['mean_decode_batch']:.1f}) vs colocated "
                    f"{row['colocated_decode_tokens_per_s']:.0f} tok/s"
                ),
            )
        )
    long = {row["concurrency"]: row for row in rows if row.get("new_tokens") == LONG_NEW_TOKENS}
    if 1 in long and 16 in long:
        growth = (
            long[16]["disaggregated_decode_tokens_per_s"]
            / long[1]["disaggregated_decode_tokens_per_s"]
        )
        heads.append(
            headline(
                f"E->P->D decode tokens/s while stepping, {LONG_NEW_TOKENS} tokens: c=16 / c=1",
                growth,
                "x",
                goal="> 1x (grows with concurrency)",
                met=growth > 1.0,
                note=(
                    f"{long[1]['disaggregated_decode_tokens_per_s']:.0f} -> "
                    + (
                        f"{long[4]['disaggregated_decode_tokens_per_s']:.0f} -> "
                        if 4 in long
                        else ""
                    )
                    + f"{long[16]['disaggregated_decode_tokens_per_s']:.0f} tok/s at c=1"
                    + (", 4" if 4 in long else "")
                    + f", 16; mean batch {long[1]['mean_decode_batch']:.1f} -> "
                    f"{long[16]['mean_decode_batch']:.1f}"
                ),
            )
        )
    heads.extend(
        headline(
            f"E->P->D / colocated TTFT p50, {row['name']}",
            row["ttft_ratio"],
            "x",
            note=(
                f"TTFT {row['disaggregated']['ttft_p50_ms']:.0f} vs "
                f"{row['colocated']['ttft_p50_ms']:.0f} ms; "
                f"tokens {'identical' if row['token_parity'] else 'DIFFER'}"
            ),
        )
        for row in rows
    )
    return heads


def main(argv: list[str] | None = None) -> int:
    import anyio

    from encdisagg.models import load_model
    from encdisagg.pipeline import LanguageModel

    options = parse_options(__doc__.splitlines()[0], argv)
    repeats = options.repeats or options.pick(3, 1)
    lm = LanguageModel.tiny()
    vision = load_model("tiny")
    rows = []
    colocated_runs: dict[str, list[dict[str, Any]]] = {}
    for cell in _scenarios(options):
        disaggregated: list[dict[str, Any]] = []
        colocated: list[dict[str, Any]] = []
        anyio.run(_colocated, {**cell, "requests": 1}, lm, vision)  # warm-up
        for _ in range(repeats):
            disaggregated.append(anyio.run(_disaggregated, cell))
            colocated.append(anyio.run(_colocated, cell, lm, vision))
        # Per repeat, then the median over repeats of each figure.
        d_sums = [_summary(run["requests"]) for run in disaggregated]
        c_sums = [_summary(run["requests"]) for run in colocated]
        parity = all(
            d["requests"][rid]["tokens"] == c["requests"][rid]["tokens"]
            for d, c in zip(disaggregated, colocated, strict=True)
            for rid in c["requests"]
        )
        row = {
            **cell,
            "disaggregated": {k: statistics.median(s[k] for s in d_sums) for k in d_sums[0]},
            "colocated": {k: statistics.median(s[k] for s in c_sums) for k in c_sums[0]},
            "disaggregated_elapsed_s": statistics.median(r["elapsed_s"] for r in disaggregated),
            "colocated_elapsed_s": statistics.median(r["elapsed_s"] for r in colocated),
            "demo_ok": all(run["ok"] for run in disaggregated),
            "token_parity": parity,
            "disaggregated_decode_tokens_per_s": statistics.median(
                r["decode_tokens_per_s"] for r in disaggregated
            ),
            "colocated_decode_tokens_per_s": statistics.median(
                r["decode_tokens_per_s"] for r in colocated
            ),
            "mean_decode_batch": statistics.median(r["mean_batch"] for r in disaggregated),
        }
        row["ttft_ratio"] = row["disaggregated"]["ttft_p50_ms"] / row["colocated"]["ttft_p50_ms"]
        row["tpot_ratio"] = row["disaggregated"]["tpot_p50_ms"] / row["colocated"]["tpot_p50_ms"]
        rows.append(row)
        colocated_runs[cell["name"]] = colocated
        print(
            f"{cell['name']:>30}: TTFT {row['disaggregated']['ttft_p50_ms']:.1f} vs "
            f"{row['colocated']['ttft_p50_ms']:.1f} ms ({row['ttft_ratio']:.2f}x), TPOT "
            f"{row['disaggregated']['tpot_p50_ms']:.2f} vs {row['colocated']['tpot_p50_ms']:.2f} "
            f"ms ({row['tpot_ratio']:.2f}x), decode {row['disaggregated_decode_tokens_per_s']:.0f} "
            f"vs {row['colocated_decode_tokens_per_s']:.0f} tok/s (batch "
            f"{row['mean_decode_batch']:.1f}), parity {parity}, demo ok {row['demo_ok']}"
        )
    _add_breakdowns(rows, colocated_runs)
    heads = headlines(rows)
    data = {"new_tokens": NEW_TOKENS, "repeats": repeats, "rows": rows, "headline": heads}
    write_json(options, "epd", data)
    _plot(options, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
