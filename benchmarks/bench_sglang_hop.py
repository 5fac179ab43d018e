"""The SGLang wire's delivery of one part: this tree against an earlier checkout, side by side.

Run as ``python benchmarks/bench_sglang_hop.py --baseline-src DIR [--pairs 5] [--parts 40]
[--quick]``, where ``DIR`` is the ``src`` folder of the checkout to compare with; writes
``sglang_hop.json``.

Each side is a long-lived child process of this project's python, importing its own
``encdisagg`` (``--baseline-src`` puts ``DIR`` first on that child's path). It serves SGLang's
``zmq_to_tokenizer`` mode as ``encdisagg serve --wire sglang`` does: an ``Encoder`` behind an
``SglangService``, driven through the service's ``encode`` with the body SGLang's tokenizer
posts, and a real ZMQ PULL socket standing in for the tokenizer's receiving port, in a
process of its own that notes when each message arrived whole. The model is a ``NullVisionModel``
(hidden 1024, float16, no compute), so the part has exactly the wanted size and the figure
is the delivery path alone: before this change, the Encoder's push to a loopback socket of
the service and the service's second push with SGLang's header (one hop and one copy per
part); after it, the Encoder's own push with SGLang's header.

A part's time runs from the ``encode`` call to the later of its answer and the whole
message's arrival at the PULL socket; parts go one at a time, each with its own content (no
cache hit). Per size (64 KiB, 1 MiB, 8 MiB), ``--pairs`` rounds alternate the order (baseline
first, then this tree first); each run builds a fresh Encoder, service and socket, sends
three untimed parts, then ``--parts`` timed ones. A size reports each side's p50 and p90
over every timed part, and this tree / baseline as the median of the per-round ratios of
p50s (below 1: faster).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    MIB,
    QUICK_RESULTS_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    ChildSide,
    Options,
    headline,
    latency_summary,
    percentile,
    serve_json_lines,
    write_json,
)

NAME = "sglang_hop"
SIZES = (64 * 1024, MIB, 8 * MIB)
HIDDEN = 1024
ROW_BYTES = HIDDEN * 2  # float16
WARMUP_PARTS = 3
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 120.0


# -- a side: one child process, one run per command -----------------------------------------


def _serve() -> int:
    """The child's loop: one run of ``parts`` parts of ``nbytes`` bytes per command."""
    import anyio

    import encdisagg

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = anyio.run(_run, command["nbytes"], command["parts"])
        return answer

    return serve_json_lines(handle, {"encdisagg": encdisagg.__version__})


#: SGLang's receiving port, in a process of its own (as SGLang's tokenizer is): one line with
#: its port, then one line per message: when it arrived whole (``time.perf_counter``, the
#: system-wide monotonic clock) and its frame sizes.
_RECEIVER = """
import sys, time, zmq
context = zmq.Context()
pull = context.socket(zmq.PULL)
print(pull.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    frames = pull.recv_multipart(copy=False)
    print(time.perf_counter(), *(len(frame.buffer) for frame in frames), flush=True)
"""


async def _run(nbytes: int, parts: int) -> dict[str, Any]:
    import gc
    import time

    import anyio.to_thread

    from encdisagg import Encoder, EncoderConfig
    from encdisagg.models import NullVisionModel
    from encdisagg.server._sglang._service import SglangService

    config = EncoderConfig.from_mapping({"model": "null", "zmq_send_timeout_s": 30.0})
    model = NullVisionModel(hidden_size=HIDDEN, tokens_per_item=nbytes // ROW_BYTES)
    receiver = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert receiver.stdout is not None
    times: list[float] = []
    try:
        port = int(receiver.stdout.readline())
        async with Encoder(config, model=model) as encoder, SglangService(encoder) as sglang:
            gc.collect()
            gc.freeze()
            for index in range(WARMUP_PARTS + parts):
                body = {
                    "req_id": f"hop-{index}_local_part_0",
                    "mm_items": [f"item-{index}"],
                    "modality": "IMAGE",
                    "num_parts": 1,
                    "part_idx": 0,
                    "prefill_host": "127.0.0.1",
                    "embedding_port": port,
                    "encoder_idx": 0,
                    "encoder_url": "http://127.0.0.1:30001",
                    "time_stats_json": None,
                }
                start = time.perf_counter()
                await sglang.encode(body)
                answered = time.perf_counter()
                with anyio.fail_after(30):
                    line = await anyio.to_thread.run_sync(receiver.stdout.readline)
                arrived, *sizes = line.split()
                if len(sizes) != 2 or int(sizes[1]) != nbytes:
                    raise RuntimeError(f"part {index} arrived as frames of {sizes} bytes")
                if index >= WARMUP_PARTS:
                    times.append(max(answered, float(arrived)) - start)
            stats = encoder.stats()
            if stats.live_requests or stats.staged_bytes:
                raise RuntimeError(f"left behind: {stats}")
    finally:
        gc.unfreeze()
        receiver.kill()
        receiver.wait(10)
        receiver.stdout.close()
    return {"times_s": times}


# -- the harness --------------------------------------------------------------------------------


def _side(label: str, src: Path) -> ChildSide:
    command = [sys.executable, str(Path(__file__).resolve()), "--serve"]
    return ChildSide(
        NAME, label, command, src=src, start_timeout_s=START_TIMEOUT_S, run_timeout_s=RUN_TIMEOUT_S
    )


def _size_name(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def _cell(sides: dict[str, ChildSide], nbytes: int, pairs: int, parts: int) -> dict[str, Any]:
    runs: dict[str, list[list[float]]] = {"base": [], "ours": []}
    for pair in range(pairs):
        order = ("base", "ours") if pair % 2 == 0 else ("ours", "base")
        for name in order:
            runs[name].append(sides[name].run(nbytes=nbytes, parts=parts)["times_s"])
    ratios = [
        percentile(ours, 50) / percentile(base, 50)
        for ours, base in zip(runs["ours"], runs["base"], strict=True)
    ]
    return {
        "size": _size_name(nbytes),
        "nbytes": nbytes,
        "ours_over_base_p50": statistics.median(ratios),
        "ratios": ratios,
        "base": latency_summary([t for run in runs["base"] for t in run]),
        "ours": latency_summary([t for run in runs["ours"] for t in run]),
        "base_run_p50_ms": [percentile(run, 50) * 1e3 for run in runs["base"]],
        "ours_run_p50_ms": [percentile(run, 50) * 1e3 for run in runs["ours"]],
    }


def _table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| part | baseline p50 / p90 ms | this tree p50 / p90 ms | this tree / baseline (p50) |",
        "|---|---|---|---|",
    ]
    for cell in cells:
        base, ours = cell["base"], cell["ours"]
        lines.append(
            f"| {cell['size']} | {base['p50_ms']:.2f} / {base['p90_ms']:.2f} | "
            f"{ours['p50_ms']:.2f} / {ours['p90_ms']:.2f} | {cell['ours_over_base_p50']:.2f}x |"
        )
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="the src folder of an earlier checkout, measured beside this one in every round",
    )
    parser.add_argument("--pairs", type=int, default=5, help="rounds per size (default 5)")
    parser.add_argument("--parts", type=int, help="timed parts per run (default 40; quick 10)")
    parser.add_argument("--quick", action="store_true", help="small runs, into results/quick/")
    parser.add_argument("--out", type=Path, help="folder for the JSON file")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.serve and args.baseline_src is None:
        parser.error("--baseline-src is required")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.serve:
        return _serve()
    if not (args.baseline_src / "encdisagg" / "__init__.py").is_file():
        raise SystemExit(f"{NAME}: no encdisagg package in {args.baseline_src}")
    pairs = 2 if args.quick else args.pairs
    parts = args.parts or (10 if args.quick else 40)
    options = Options(
        quick=args.quick,
        out=args.out or (QUICK_RESULTS_DIR if args.quick else RESULTS_DIR),
        repeats=pairs,
    )
    sides: dict[str, ChildSide] = {}
    try:
        sides["base"] = _side("the baseline", args.baseline_src.resolve())
        sides["ours"] = _side("this tree", REPO_ROOT / "src")
        cells = []
        for nbytes in SIZES:
            cells.append(_cell(sides, nbytes, pairs, parts))
            print(_table(cells[-1:]).splitlines()[-1], flush=True)
    finally:
        for side in sides.values():
            side.close()
    print()
    print(_table(cells))
    data = {
        "settings": {
            "pairs": pairs,
            "parts_per_run": parts,
            "warmup_parts": WARMUP_PARTS,
            "model": f"NullVisionModel, hidden {HIDDEN}, float16",
            "mode": "zmq_to_tokenizer: SglangService.encode, a real PULL socket on 127.0.0.1",
            "baseline": "an earlier checkout's src, beside",
        },
        "cells": cells,
        "table_md": _table(cells),
        "headline": [
            headline(
                f"SGLang wire part {cell['size']}: this tree / baseline p50",
                round(cell["ours_over_base_p50"], 3),
                "x",
                note=f"p50 {cell['ours']['p50_ms']:.2f} vs {cell['base']['p50_ms']:.2f} ms, "
                f"p90 {cell['ours']['p90_ms']:.2f} vs {cell['base']['p90_ms']:.2f} ms; "
                f"median of {pairs} alternated pairs",
            )
            for cell in cells
        ],
    }
    write_json(options, NAME, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
