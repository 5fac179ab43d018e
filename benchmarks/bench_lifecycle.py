"""Lifecycle overhead: encode + send + release per second with a model and engine that cost
nothing.

Run as ``python benchmarks/bench_lifecycle.py [--quick]``; writes ``lifecycle.json`` and
``lifecycle.png``.

The Encoder runs ``NullVisionModel`` (16 tokens x 64 hidden, float16: 2 KiB per request) and a
``LoopbackEngine`` (both say their calls do not block, so the Encoder makes them inline); a
second engine on the same fabric holds the receivers' registered buffers. One operation is
``encode`` (stage into the pre-registered staging arena), ``send`` to a
``MooncakeDestination`` (copy, then the request is released and its arena block freed)
and an explicit ``release`` (a no-op by then, as a client would call it). ``C`` tasks run
operations back to back until the count is reached; the latency of one operation is from
its ``encode`` call to its ``release`` return.

For comparison, the same work without the Encoder (``preprocess``, ``forward``,
``register``, ``write``, ``deregister`` called directly in a loop, one thread, no event
loop) gives the floor: the ratio shows what the ownership tree, batching, worker-thread
hops and bookkeeping cost per operation.

Each of the three calls is a checkpoint, and with nothing else to wait for, each one's
schedule point is a whole pass through the event loop. At concurrency 1 every pair also
runs the Encoder with its calls made cancel points alone (an attribution of cost, not a mode
users get: a loop of such calls would never let another task run), to show what those three
passes cost beside the rest.

Concurrency 1, 64 and 256, on asyncio and on Trio. Every cell is measured in pairs with the
floor (five by default, ``--repeats``), side by side in one run (the order inside a pair
alternates); a cell's ratio is the median of its pairs' ratios, and its rate the median run.
``bench_instructions.py`` counts the one-task cell and the floor in instructions instead.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

from _common import (
    Options,
    headline,
    latency_summary,
    parse_options,
    write_json,
    write_png,
)

CONCURRENCY = (1, 64, 256)
BACKENDS = ("asyncio", "trio")
TOKENS = 16
# Goal for the rate against the floor measured beside it.
GOAL = 0.25
HIDDEN = 64


def _parts() -> tuple[Any, Any, Any, list[Any]]:
    import torch

    from encdisagg.models import NullVisionModel
    from encdisagg.transfer import LoopbackEngine, LoopbackFabric

    fabric = LoopbackFabric()
    receiver = LoopbackEngine(fabric, name="receiver")
    sender = LoopbackEngine(fabric, name="sender")
    nbytes = TOKENS * HIDDEN * 2
    buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(max(CONCURRENCY))]
    for buffer in buffers:
        receiver.register(buffer.data_ptr(), nbytes)
    model = NullVisionModel(hidden_size=HIDDEN, tokens_per_item=TOKENS, dtype=torch.float16)
    return model, sender, receiver, buffers


async def _run_cell(
    concurrency: int, operations: int, tag: str, *, schedule_points: bool = True
) -> dict[str, Any]:
    import anyio

    from encdisagg import Encoder, EncoderConfig, EncodeRequest, MooncakeDestination

    model, sender, _receiver, buffers = _parts()
    config = EncoderConfig(transfer="loopback", max_batch_size=8, max_queued_jobs=4096)
    latencies: list[float] = []
    counter = iter(range(operations))
    async with Encoder(config, model=model, engine=sender) as encoder:
        if not schedule_points:
            # What the three schedule points cost (an attribution, not a mode users get):
            # the Encoder's calls become cancel points alone. Nothing else here waits.
            encoder._lifecycle.checkpoint = anyio.lowlevel.checkpoint_if_cancelled

        async def worker(slot: int) -> None:
            destination = MooncakeDestination("receiver", buffers[slot].data_ptr(), f"rx:{slot}")
            for index in counter:
                rid = f"{tag}-{index}"
                start = time.perf_counter()
                await encoder.encode(EncodeRequest(rid, [rid]))
                await encoder.send(rid, destination)
                await encoder.release(rid)
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        with anyio.fail_after(600):
            async with anyio.create_task_group() as group:
                for slot in range(concurrency):
                    group.start_soon(worker, slot)
        elapsed = time.perf_counter() - start
        stats = encoder.stats()
        assert stats.live_requests == 0, stats
        assert stats.staged_bytes == 0, stats
        # Only the staging arena stays registered while the encoder is open.
        assert stats.registered_regions == 1, stats
    assert encoder.stats().registered_regions == 0
    assert sender.registered_regions() == 0
    return {
        "concurrency": concurrency,
        "operations": len(latencies),
        "ops_per_s": len(latencies) / elapsed,
        "latency": latency_summary(latencies),
    }


def _run_bare(operations: int, tag: str, backend: str) -> dict[str, Any]:
    import anyio

    return anyio.run(partial(_run_cell, 1, operations, tag, schedule_points=False), backend=backend)


def _raw_floor(operations: int) -> dict[str, Any]:
    """The same calls without the Encoder: one thread, no event loop."""
    from encdisagg import Modality

    model, sender, _receiver, buffers = _parts()
    target = buffers[0].data_ptr()
    latencies = []
    start = time.perf_counter()
    for index in range(operations):
        begin = time.perf_counter()
        rid = f"raw-{index}"
        pre = model.preprocess([rid], Modality.IMAGE)
        (tensor,) = model.forward([pre])
        ptr = tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        sender.register(ptr, nbytes)
        sender.write("receiver", ptr, target, nbytes)
        sender.deregister(ptr)
        latencies.append(time.perf_counter() - begin)
    elapsed = time.perf_counter() - start
    return {
        "operations": operations,
        "ops_per_s": operations / elapsed,
        "latency": latency_summary(latencies),
    }


def _median_cell(cells: list[dict[str, Any]], floors: list[float]) -> dict[str, Any]:
    ordered = sorted(cells, key=lambda cell: cell["ops_per_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["ops_per_s_repeats"] = [cell["ops_per_s"] for cell in cells]
    chosen["floor_ops_per_s_repeats"] = floors
    chosen["ratio_to_floor"] = statistics.median(
        cell["ops_per_s"] / floor for cell, floor in zip(cells, floors, strict=True)
    )
    return chosen


def _plot(options: Options, data: dict[str, Any]) -> None:
    def draw(fig: Any) -> None:
        left = fig.add_subplot(1, 2, 1)
        right = fig.add_subplot(1, 2, 2)
        for backend, color in zip(BACKENDS, ("#3b75af", "#e1812c"), strict=True):
            cells = data["cells"][backend]
            xs = [cell["concurrency"] for cell in cells]
            left.plot(xs, [c["ops_per_s"] for c in cells], "o-", color=color, label=backend)
            right.plot(
                xs,
                [c["latency"]["p50_ms"] for c in cells],
                "o-",
                color=color,
                label=f"{backend} p50",
            )
            right.plot(
                xs,
                [c["latency"]["p99_ms"] for c in cells],
                "s--",
                color=color,
                label=f"{backend} p99",
            )
        left.axhline(data["raw"]["ops_per_s"], color="#999999", ls=":", label="raw calls (floor)")
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(CONCURRENCY), [str(c) for c in CONCURRENCY])
            ax.set_xlabel("concurrent tasks")
            ax.legend(fontsize=7)
        left.set_ylabel("encode+send+release per s")
        left.set_yscale("log")
        right.set_ylabel("latency (ms)")
        right.set_yscale("log")
        fig.suptitle("Request lifecycle with a null model and a loopback engine")

    write_png(options, "lifecycle", draw, size=(11, 4.2))


def main(argv: list[str] | None = None) -> int:
    import anyio

    options = parse_options(__doc__.splitlines()[0], argv)
    # Five pairs per cell: at one task single pairs swing by a fifth either way.
    repeats = options.repeats or options.pick(5, 1)
    operations = options.pick(3000, 300)
    raw = _raw_floor(operations)
    print(f"raw floor: {raw['ops_per_s']:.0f} ops/s")
    cells: dict[str, list[dict[str, Any]]] = {backend: [] for backend in BACKENDS}
    for concurrency in CONCURRENCY:
        for backend in BACKENDS:
            runs, floors, bare = [], [], []
            for r in range(max(repeats, 3)):
                if r % 2 == 0:
                    floors.append(_raw_floor(operations)["ops_per_s"])
                # At one task the run without schedule points comes after, then before.
                if concurrency == 1 and r % 2 == 1:
                    bare.append(_run_bare(operations, f"bare-{r}", backend))
                runs.append(
                    anyio.run(
                        _run_cell, concurrency, operations, f"c{concurrency}-{r}", backend=backend
                    )
                )
                if concurrency == 1 and r % 2 == 0:
                    bare.append(_run_bare(operations, f"bare-{r}", backend))
                if r % 2 == 1:
                    floors.append(_raw_floor(operations)["ops_per_s"])
            cell = _median_cell(runs, floors)
            if bare:
                cell["without_schedule_points"] = _median_cell(bare, floors)
            cells[backend].append(cell)
            print(
                f"{backend:>7} c={concurrency:<3}: {cell['ops_per_s']:7.0f} ops/s "
                f"({cell['ratio_to_floor']:.2f}x the floor beside it), "
                f"p50 {cell['latency']['p50_ms']:.2f} ms, p99 {cell['latency']['p99_ms']:.2f} ms"
            )
            if bare:
                print(
                    f"{'':>7}        without the schedule points: "
                    f"{cell['without_schedule_points']['ratio_to_floor']:.2f}x the floor"
                )
    heads = [
        headline(
            f"lifecycle {backend} c={cell['concurrency']} / raw floor",
            cell["ratio_to_floor"],
            "x",
            goal=f">= {GOAL}x",
            met=cell["ratio_to_floor"] >= GOAL,
            note=(
                f"{cell['ops_per_s']:.0f} ops/s; "
                f"p50 {cell['latency']['p50_ms']:.2f} ms, p99 "
                f"{cell['latency']['p99_ms']:.2f} ms; "
                f"{cell['ratio_to_floor']:.2f}x raw calls (pairs measured side by side)"
                + (
                    f"; {cell['without_schedule_points']['ratio_to_floor']:.2f}x without "
                    "the three schedule points"
                    if "without_schedule_points" in cell
                    else ""
                )
            ),
        )
        for backend in BACKENDS
        for cell in cells[backend]
    ]
    trio_vs_asyncio = statistics.median(
        t["ops_per_s"] / a["ops_per_s"]
        for a, t in zip(cells["asyncio"], cells["trio"], strict=True)
    )
    data = {
        "operations": operations,
        "repeats": repeats,
        "embedding_bytes": TOKENS * HIDDEN * 2,
        "raw": raw,
        "cells": cells,
        "trio_over_asyncio_median": trio_vs_asyncio,
        "headline": heads,
    }
    write_json(options, "lifecycle", data)
    _plot(options, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
