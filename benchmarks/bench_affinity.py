"""Affinity: prefix-cache hit rate of a 3-encoder fleet, affine vs least-loaded routing.

Run as ``python benchmarks/bench_affinity.py [--quick]``; writes ``affinity.json`` and
``affinity.png``. Needs etcd (Debian's ``etcd-server`` package); without it the run records
why it skipped.

A real etcd runs on 127.0.0.1. For each routing mode, three fresh in-process encoders (null
model, ``prefix_cache_mb=64``, each behind its own Hypercorn server on loopback) register
under a prefix of their own with the server's defaults (5 s lease, load refreshed every 2 s).
One ``EncoderClient`` over an ``EncoderFleet`` of that routing (affine with the default load
bound 1.25 and with 2.0, then least-loaded) sends the same seeded stream
of single-image requests with ``fetch_from_fleet`` from ``C`` concurrent tasks. In the
stream, each request repeats an image already sent (drawn uniformly from those) with
probability 0.3, else sends a new one; so about 30 % of requests could be cache hits at
best. The hit rate is the encoders' summed local-cache hits over hits plus misses.

The null model costs nothing, so this measures where repeats land, not what a hit saves (see
``bench_cache.py`` for that: a hit is about 30x faster than a miss on the tiny model).
"""

from __future__ import annotations

import json
import random
import time
from contextlib import AsyncExitStack
from typing import Any

from _common import Options, headline, parse_options, write_json, write_png
from bench_fleet import Etcd, etcd_or_skip

NAME = "affinity"
CONCURRENCY = 8
REPEAT_SHARE = 0.3
ENCODERS = 3
#: (routing, load_bound): the default, a looser bound, and the routing by load alone.
MODES = (("affine", 1.25), ("affine", 2.0), ("least_loaded", 1.25))


def workload(count: int, seed: int = 7) -> list[str]:
    """``count`` items; each repeats an earlier one with probability ``REPEAT_SHARE``."""
    rng = random.Random(seed)
    items: list[str] = []
    fresh = 0
    for _ in range(count):
        if items and rng.random() < REPEAT_SHARE:
            items.append(rng.choice(items))
        else:
            items.append(f"image-{fresh:06d}")
            fresh += 1
    return items


async def _run_mode(
    registry: str, mode: str, load_bound: float, items: list[str]
) -> dict[str, Any]:
    import anyio

    from encdisagg import Encoder, EncoderConfig, Modality
    from encdisagg.models import NullVisionModel
    from encdisagg.pipeline import serve_asgi
    from encdisagg.receiver import (
        EmbeddingReceiver,
        EncoderClient,
        EncoderFleet,
        FleetRouting,
        fetch_from_fleet,
    )
    from encdisagg.registry import EncoderLoad, EncoderRecord, Registration
    from encdisagg.server import create_app

    model = NullVisionModel()
    encoders: list[Encoder] = []
    async with AsyncExitStack() as stack:
        for _ in range(ENCODERS):
            config = EncoderConfig(model="null", prefix_cache_mb=64)
            encoder = await stack.enter_async_context(Encoder(config, model=NullVisionModel()))
            encoders.append(encoder)
            url = await stack.enter_async_context(serve_asgi(create_app(encoder)))

            async def load(encoder: Encoder = encoder) -> EncoderLoad:
                stats = encoder.stats()
                return EncoderLoad(stats.live_requests, stats.staged_bytes)

            record = EncoderRecord(
                url=url,
                model="null",
                modalities=(Modality.IMAGE,),
                transfers=("zmq",),
                capacity=8,
            )
            registration = await stack.enter_async_context(
                Registration(registry, record, load=load)
            )
            await registration.wait_registered()
        fleet = EncoderFleet(registry, routing=FleetRouting(routing=mode, load_bound=load_bound))
        client = await stack.enter_async_context(EncoderClient(registry=fleet))
        receiver = await stack.enter_async_context(
            EmbeddingReceiver(transport="zmq", hidden_size=model.hidden_size, dtype=model.dtype)
        )
        with anyio.fail_after(30):
            await fleet.wait_for(ENCODERS)
        queue = list(enumerate(items))
        queue.reverse()

        async def worker() -> None:
            while queue:
                index, item = queue.pop()
                async with fetch_from_fleet(client, receiver, f"r{index}", {"image": [item]}):
                    pass

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for _ in range(CONCURRENCY):
                group.start_soon(worker)
        seconds = time.perf_counter() - start
        stats = [encoder.cache.stats() for encoder in encoders]
    hits = sum(s.hits for s in stats)
    misses = sum(s.misses for s in stats)
    return {
        "routing": mode,
        "load_bound": load_bound if mode == "affine" else None,
        "label": f"{mode} (c={load_bound})" if mode == "affine" else mode,
        "requests": len(items),
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "per_encoder_requests": sorted((s.hits + s.misses for s in stats), reverse=True),
        "requests_per_s": len(items) / seconds,
    }


async def _run(registry_base: str, count: int) -> dict[str, Any]:
    items = workload(count)
    repeats = len(items) - len(set(items))
    rows = [
        await _run_mode(f"{registry_base}{mode}-{bound}/", mode, bound, items)
        for mode, bound in MODES
    ]
    return {"rows": rows, "repeat_share": repeats / len(items), "concurrency": CONCURRENCY}


def _plot(options: Options, data: dict[str, Any]) -> None:
    rows = data["rows"]

    def draw(fig: Any) -> None:
        ax = fig.subplots(1, 1)
        names = [row["label"] for row in rows]
        bars = ax.bar(names, [100 * row["hit_rate"] for row in rows], color="#4c72b0")
        ax.axhline(100 * data["repeat_share"], color="grey", linestyle="--", label="repeats")
        ax.bar_label(bars, fmt="%.1f %%")
        ax.set_ylabel("prefix-cache hit rate (%)")
        ax.legend(fontsize=7)
        fig.suptitle(f"{ENCODERS} encoders, {rows[0]['requests']} requests, c={CONCURRENCY}")

    write_png(options, NAME, draw, size=(5, 4))


def main(argv: list[str] | None = None) -> int:
    options = parse_options(__doc__.splitlines()[0], argv)
    binary = etcd_or_skip(options, NAME)
    if binary is None:
        return 0
    import anyio

    etcd = Etcd(binary)
    try:
        registry = f"etcd://{etcd.endpoint}/bench-affinity/"
        data = anyio.run(_run, registry, options.pick(1500, 300), backend="asyncio")
    finally:
        etcd.close()
    data["headline"] = [
        headline(
            f"prefix-cache hit rate, {row['label']} routing",
            100 * row["hit_rate"],
            "%",
            note=(
                f"{ENCODERS} encoders, {100 * data['repeat_share']:.1f} % of requests repeat "
                f"an image; requests per encoder {row['per_encoder_requests']}"
            ),
        )
        for row in data["rows"]
    ]
    write_json(options, NAME, data)
    _plot(options, data)
    print(json.dumps(data["headline"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
