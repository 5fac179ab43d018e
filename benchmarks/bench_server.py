"""Server responsiveness: ``/health`` while 200 concurrent ``/encode`` of 1280x720 images run.

Run as ``python benchmarks/bench_server.py [--quick]``; writes ``server.json``.

The server is ``encdisagg serve --model tiny`` in a child process, once with
``--worker-class asyncio`` (Quart) and once with ``trio`` (QuartTrio), driven by the same
client (httpx on asyncio). The client first
times ``/health`` on the idle server (each call runs a real probe encode), then posts 200
``/encode`` requests at once, each with its own 1280x720 PNG (base64 data URL, about
1.9 MiB of JSON; 1196 image tokens each), followed by ``/release``. While they run, a
thread of the client polls ``/health`` every 20 ms (blocking httpx, so a busy client event
loop does not delay its polls). Reported:

- ``/health`` latency under load (p50, p99, max): what a load balancer's probe sees. The
  server skips the probe encode while encodes make progress, so this measures whether the
  event loop stays free while bodies are decoded, images preprocessed and the model runs
  (all of which happen in worker threads).
- encode throughput (requests/s over the whole burst) and per-request latency.

Client and server share the machine's cores, so figures are lower bounds.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import threading
import time
from typing import Any

import anyio
import httpx
import numpy as np
from _common import Options, Server, headline, latency_summary, parse_options, write_json
from PIL import Image

FLAVOURS = ("asyncio", "trio")
WIDTH, HEIGHT = 1280, 720
HEALTH_GOAL_MS = 250.0
#: Pause between two /health polls (each poll waits for the previous answer).
POLL_INTERVAL_S = 0.02


def _image(seed: int) -> str:
    """A 1280x720 PNG data URL: smooth gradients with a per-seed pattern and a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    pixels = np.stack(
        [
            (x * (1 + seed % 5) // 6) % 256,
            (y * (1 + seed % 3) // 3) % 256,
            ((x + y + seed * 17) // 4) % 256,
        ],
        axis=-1,
    ).astype(np.int16)
    pixels += rng.integers(-3, 4, pixels.shape, dtype=np.int16)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, "PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _bodies(images: list[str]) -> list[bytes]:
    """The /encode bodies, serialised up front so the client's loop only does I/O."""
    return [
        json.dumps({"req_id": f"bench-{index}", "mm_items": [image]}).encode()
        for index, image in enumerate(images)
    ]


class _Prober:
    """Polls /health from a thread of its own (blocking httpx), so what it measures is the
    server, not the load generator's event loop."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.latencies: list[float] = []
        self.statuses: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="health prober")

    def _run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=600.0) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                response = client.get("/health")
                self.latencies.append(time.perf_counter() - start)
                key = str(response.status_code)
                self.statuses[key] = self.statuses.get(key, 0) + 1
                self._stop.wait(POLL_INTERVAL_S)

    def __enter__(self) -> _Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _run(url: str, bodies: list[bytes]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies))
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600.0) as client:
        idle: list[float] = []
        for _ in range(10):
            start = time.perf_counter()
            response = await client.get("/health")
            idle.append(time.perf_counter() - start)
            response.raise_for_status()

        encode_s: list[float] = []
        statuses: dict[str, int] = {}

        async def one(index: int, body: bytes) -> None:
            start = time.perf_counter()
            response = await client.post("/encode", content=body, headers=headers)
            encode_s.append(time.perf_counter() - start)
            key = str(response.status_code)
            statuses[key] = statuses.get(key, 0) + 1
            await client.post("/release", json={"req_id": f"bench-{index}"})

        with _Prober(url) as prober:
            start = time.perf_counter()
            async with anyio.create_task_group() as burst:
                for index, body in enumerate(bodies):
                    burst.start_soon(one, index, body)
            wall = time.perf_counter() - start

        metrics = (await client.get("/metrics")).text
    return {
        "requests": len(bodies),
        "wall_s": wall,
        "throughput_rps": len(bodies) / wall,
        "encode_latency": latency_summary(encode_s),
        "health_idle": latency_summary(idle),
        "health_under_load": latency_summary(prober.latencies),
        "encode_statuses": statuses,
        "health_statuses": prober.statuses,
        "server_live_requests_after": _gauge(metrics, "encdisagg_live_requests"),
    }


def _gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def burst_bodies(options: Options) -> tuple[int, list[bytes], float]:
    """The burst's request bodies (one 1280x720 image each): count, bodies, MiB per body."""
    count = options.pick(200, 24)
    print(f"generating {count} {WIDTH}x{HEIGHT} images...", flush=True)
    bodies = _bodies([_image(seed) for seed in range(count)])
    return count, bodies, sum(len(body) for body in bodies) / count / 2**20


def tiny_server(flavour: str) -> Server:
    """``encdisagg serve`` on the tiny model with ``flavour``'s worker class, port 0."""
    command = [
        "-m", "encdisagg", "serve", "--port", "0", "--model", "tiny",
        "--worker-class", flavour, "--log-level", "warning",
    ]  # fmt: skip
    return Server(command)


def main(argv: list[str] | None = None) -> int:
    options: Options = parse_options(__doc__.splitlines()[0], argv)
    count, bodies, body_mib = burst_bodies(options)
    runs: dict[str, Any] = {}
    for flavour in FLAVOURS:
        with tiny_server(flavour) as server:
            print(f"{flavour}: {count} concurrent /encode against {server.url}", flush=True)
            # The same client (httpx on asyncio) for both flavours: only the server differs.
            runs[flavour] = anyio.run(_run, server.url, bodies, backend="asyncio")
        run = runs[flavour]
        print(
            f"{flavour}: {run['throughput_rps']:.2f} encodes/s; /health under load "
            f"p50 {run['health_under_load']['p50_ms']:.1f} ms, "
            f"p99 {run['health_under_load']['p99_ms']:.1f} ms "
            f"({run['health_under_load']['n']} polls)",
            flush=True,
        )
    heads = []
    for flavour, run in runs.items():
        p99 = run["health_under_load"]["p99_ms"]
        heads += [
            headline(
                f"/health p99 during {count} concurrent encodes ({flavour})",
                p99,
                "ms",
                goal=f"< {HEALTH_GOAL_MS:.0f} ms",
                met=p99 < HEALTH_GOAL_MS,
                note=f"p50 {run['health_under_load']['p50_ms']:.1f} ms",
            ),
            headline(
                f"encode throughput, 1280x720, tiny model ({flavour})",
                run["throughput_rps"],
                "req/s",
                note=f"p50 latency {run['encode_latency']['p50_ms'] / 1e3:.1f} s",
            ),
        ]
    write_json(
        options,
        "server",
        {
            "what": "/health latency and encode throughput during a burst of concurrent encodes",
            "image": f"{WIDTH}x{HEIGHT} PNG, {body_mib:.2f} MiB per request body",
            "model": "tiny (seeded Qwen2-VL architecture, CPU)",
            "concurrency": count,
            "runs": runs,
            "headline": heads,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
