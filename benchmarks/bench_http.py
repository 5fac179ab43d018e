"""HTTP: ``/encode`` + ``/send`` through Hypercorn with the null model at concurrency 64.

Run as ``python benchmarks/bench_http.py [--quick]``; writes ``http.json`` and ``http.png``.

The server is ``encdisagg serve --model null --transfer zmq`` in a child process, once with
``--worker-class asyncio`` (Quart) and once with ``trio`` (QuartTrio). The client (aiohttp on
asyncio, 64 connections) runs 64 tasks; each posts ``/encode`` for one item (the null model:
16 tokens x 64 hidden, 2 KiB) and then ``/send`` with a ``receive_url`` of a ZMQ receiver in
the client process, which drains every pushed embedding. One *pair* is both calls.

For comparison, the same client drives a bare Quart (or QuartTrio) app on the same Hypercorn
runner whose two routes parse the body and answer a fixed JSON (no Encoder): the ceiling of
the HTTP stack on this machine. The ratio encdisagg / bare shows what the Encoder adds per
request. A third server, the same one started with ``--no-freeze-heap``, shows what freezing
the startup heap is worth (``docs/server.md``). Runs alternate and repeat; the median is
kept.

Client and server share the machine's cores, so absolute figures are lower bounds. The load
generator is aiohttp: httpx's connection pool itself tops out near 150 requests/s at 64
concurrent requests on a 2-core machine (about 1,200 at 8), which would measure the client.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from _common import (
    Options,
    Server,
    headline,
    label_bars,
    latency_summary,
    parse_options,
    rss_mib,
    spread,
    write_json,
    write_png,
)

CONCURRENCY = 64
FLAVOURS = ("asyncio", "trio")


# -- the bare app (child process) ---------------------------------------------------------


def _bare_server(flavour: str) -> None:
    import json

    import anyio

    from encdisagg.server import serve

    if flavour == "trio":
        from quart_trio import QuartTrio as App
    else:
        from quart import Quart as App
    from quart import request

    app = App("bare")

    @app.post("/encode")
    async def encode() -> Any:
        body = json.loads(await request.get_data())
        return {
            "req_id": body["req_id"],
            "part_idx": 0,
            "embedding_size": 2048,
            "embedding_len": 16,
            "embedding_dim": 64,
            "token_counts": [16],
            "grid": [[1, 2, 32]],
        }

    @app.post("/send")
    async def send() -> Any:
        json.loads(await request.get_data())
        return app.response_class("null", content_type="application/json")

    async def run() -> None:
        stop = anyio.Event()
        with anyio.open_signal_receiver(15) as signals:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    async for _ in signals:
                        stop.set()
                        return

                group.start_soon(watch)
                await serve(
                    app,
                    shutdown_trigger=stop.wait,
                    on_serving=lambda url: print(f"bare serving on {url}", flush=True),
                )
                group.cancel_scope.cancel()

    anyio.run(run, backend=flavour)


# -- the load ---------------------------------------------------------------------------------


async def _load(url: str, pairs: int, tag: str, send: bool = True) -> dict[str, Any]:
    """``pairs`` /encode + /send pairs from CONCURRENCY tasks (aiohttp, on asyncio)."""
    try:
        import aiohttp
    except ImportError as exc:
        raise SystemExit(f"bench_http.py needs aiohttp (the 'bench' extra): {exc}") from exc
    import anyio

    from encdisagg.transfer import ZmqReceiver

    pair_latency: list[float] = []
    encode_latency: list[float] = []
    send_latency: list[float] = []
    errors: dict[str, int] = {}
    received = 0
    counter = iter(range(pairs))
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=60)
    async with (
        ZmqReceiver(max_queued_messages=1024) as receiver,
        aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as client,
    ):

        async def drain() -> None:
            nonlocal received
            while True:
                await receiver.receive()
                received += 1

        async def post(route: str, body: dict[str, Any]) -> int:
            async with client.post(route, json=body) as response:
                await response.read()
                return response.status

        def failed(route: str, status: int) -> None:
            key = f"{route} {status}"
            errors[key] = errors.get(key, 0) + 1

        async def worker() -> None:
            for index in counter:
                rid = f"{tag}-{index}"
                start = time.perf_counter()
                status = await post("/encode", {"req_id": rid, "mm_items": [rid]})
                middle = time.perf_counter()
                if status != 200:
                    failed("encode", status)
                    continue
                status = await post("/send", {"req_id": rid, "receive_url": receiver.url})
                end = time.perf_counter()
                if status != 200:
                    failed("send", status)
                    continue
                encode_latency.append(middle - start)
                send_latency.append(end - middle)
                pair_latency.append(end - start)

        async with anyio.create_task_group() as outer:
            if send:
                outer.start_soon(drain)
            start = time.perf_counter()
            with anyio.fail_after(600):
                async with anyio.create_task_group() as group:
                    for _ in range(CONCURRENCY):
                        group.start_soon(worker)
            elapsed = time.perf_counter() - start
            if send:
                with anyio.move_on_after(10):
                    while received < len(pair_latency):
                        await anyio.sleep(0.01)
            outer.cancel_scope.cancel()
    return {
        "pairs": len(pair_latency),
        "pairs_per_s": len(pair_latency) / elapsed,
        "http_requests_per_s": 2 * len(pair_latency) / elapsed,
        "pair": latency_summary(pair_latency),
        "encode": latency_summary(encode_latency),
        "send": latency_summary(send_latency),
        "errors": errors,
        "received": received,
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda run: run["pairs_per_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["pairs_per_s_repeats"] = spread([run["pairs_per_s"] for run in runs])
    return chosen


def _measure(options: Options, flavour: str, repeats: int, pairs: int) -> dict[str, Any]:
    import anyio

    serve_args = [
        "-m",
        "encdisagg",
        "serve",
        "--model",
        "null",
        "--transfer",
        "zmq",
        "--port",
        "0",
        "--worker-class",
        flavour,
        "--log-level",
        "warning",
    ]
    encdisagg_runs = []
    unfrozen_runs = []
    bare_runs = []
    with (
        Server(serve_args) as server,
        Server([*serve_args, "--no-freeze-heap"]) as unfrozen,
        Server([__file__, "--bare", flavour]) as bare,
    ):
        rss_start = rss_mib(server.pid)
        anyio.run(_load, server.url, min(pairs, 200), f"warm-{flavour}")
        anyio.run(_load, unfrozen.url, min(pairs, 200), f"warm-{flavour}")
        anyio.run(_load, bare.url, min(pairs, 200), "warm", False)
        for repeat in range(repeats):
            encdisagg_runs.append(anyio.run(_load, server.url, pairs, f"{flavour}-{repeat}"))
            unfrozen_runs.append(anyio.run(_load, unfrozen.url, pairs, f"{flavour}-{repeat}"))
            bare_runs.append(anyio.run(_load, bare.url, pairs, "bare", False))
        rss_end = rss_mib(server.pid)
    result = {
        "flavour": flavour,
        "encdisagg": _median_run(encdisagg_runs),
        # The same server with --no-freeze-heap: what freezing the startup heap is worth.
        "unfrozen": _median_run(unfrozen_runs),
        "bare": _median_run(bare_runs),
        "server_rss_mib": {"start": rss_start, "end": rss_end},
    }
    result["ratio"] = result["encdisagg"]["pairs_per_s"] / result["bare"]["pairs_per_s"]
    result["frozen_over_unfrozen"] = statistics.median(
        frozen["pairs_per_s"] / thawed["pairs_per_s"]
        for frozen, thawed in zip(encdisagg_runs, unfrozen_runs, strict=True)
    )
    run, thawed = result["encdisagg"], result["unfrozen"]
    print(
        f"{flavour:>7}: {run['pairs_per_s']:.0f} pairs/s ({run['http_requests_per_s']:.0f} req/s), "
        f"pair p50 {run['pair']['p50_ms']:.1f} ms p99 {run['pair']['p99_ms']:.1f} ms; bare "
        f"{result['bare']['pairs_per_s']:.0f} pairs/s; ratio {result['ratio']:.2f}; "
        f"errors {run['errors']}; --no-freeze-heap: {thawed['pairs_per_s']:.0f} pairs/s, "
        f"pair p99 {thawed['pair']['p99_ms']:.1f} ms"
    )
    return result


def _plot(options: Options, rows: list[dict[str, Any]]) -> None:
    def draw(fig: Any) -> None:
        left = fig.add_subplot(1, 2, 1)
        right = fig.add_subplot(1, 2, 2)
        xs = list(range(len(rows)))
        width = 0.38
        bars = left.bar(
            [x - width / 2 for x in xs],
            [row["bare"]["pairs_per_s"] for row in rows],
            width,
            color="#999999",
            label="bare Quart routes",
        )
        label_bars(left, bars)
        bars = left.bar(
            [x + width / 2 for x in xs],
            [row["encdisagg"]["pairs_per_s"] for row in rows],
            width,
            color="#3b75af",
            label="encdisagg /encode + /send",
        )
        label_bars(left, bars)
        left.set_xticks(xs, [row["flavour"] for row in rows])
        left.set_ylabel("pairs/s (median)")
        left.legend(fontsize=7)
        for index, route in enumerate(("encode", "send", "pair")):
            offsets = [x + (index - 1) * 0.25 for x in xs]
            p99 = right.bar(
                offsets,
                [row["encdisagg"][route]["p99_ms"] for row in rows],
                0.25,
                label=f"{route} p99",
            )
            label_bars(right, p99, "{:.0f}")
        right.set_xticks(xs, [row["flavour"] for row in rows])
        right.set_ylabel("p99 latency (ms)")
        right.legend(fontsize=7)
        fig.suptitle(f"HTTP through Hypercorn, null model, concurrency {CONCURRENCY}")

    write_png(options, "http", draw, size=(10, 4))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--bare"]:
        _bare_server(args[1])
        return 0
    options = parse_options(__doc__.splitlines()[0], args)
    repeats = options.repeats or options.pick(3, 1)
    pairs = options.pick(3000, 300)
    rows = [_measure(options, flavour, repeats, pairs) for flavour in FLAVOURS]
    heads = []
    for row in rows:
        run = row["encdisagg"]
        heads.append(
            headline(
                f"HTTP /encode+/send c=64 ({row['flavour']})",
                run["http_requests_per_s"],
                "req/s",
                note=(
                    f"{run['pairs_per_s']:.0f} pairs/s, pair p50 {run['pair']['p50_ms']:.0f} ms "
                    f"p99 {run['pair']['p99_ms']:.0f} ms; {row['ratio']:.2f}x bare Quart"
                ),
            )
        )
        thawed = row["unfrozen"]
        heads.append(
            headline(
                f"HTTP freeze_heap on / off ({row['flavour']})",
                row["frozen_over_unfrozen"],
                "x",
                note=(
                    f"pairs/s, median of runs alternated in one run; pair p99 "
                    f"{run['pair']['p99_ms']:.0f} ms frozen vs {thawed['pair']['p99_ms']:.0f} ms "
                    "with --no-freeze-heap"
                ),
            )
        )
    data = {"concurrency": CONCURRENCY, "pairs": pairs, "repeats": repeats, "rows": rows}
    data["headline"] = heads
    write_json(options, "http", data)
    _plot(options, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
