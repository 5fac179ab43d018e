"""Memory under a burst: peak RSS and ``/health`` latency during 200 concurrent 1280x720 encodes.

Run as ``python benchmarks/bench_hostile.py [--quick]``; writes ``hostile.json``.

The server is ``encdisagg serve --model tiny`` in a child process, once per worker class
(``asyncio``: Quart, ``trio``: QuartTrio). The client (httpx on asyncio) posts 200
``/encode`` requests at once, each with its own 1280x720 PNG (a base64 data URL, about
1.9 MiB of JSON), then ``/release``. A server over its memory budget answers 503 with
``Retry-After``; the client then waits that long (at most 2 s) and tries again, as a well
behaved client would, so every request is encoded in the end. Meanwhile one thread polls
``/health`` every 20 ms and another samples the server's resident memory from
``/proc/<pid>/status`` every 20 ms. Reported per worker class:

- peak RSS of the server process (``VmHWM``, the kernel's own high-water mark, read after
  the burst; the sampled maximum beside it), and its RSS when idle before the burst;
- ``/health`` latency during the burst (p50, p99, max);
- how many encodes were answered 503 before they got through, and the burst's wall time.

Goal: peak RSS under 2 GiB and ``/health`` p99 under 100 ms. Client and server share the
machine's cores, so the latencies are upper bounds of what the server alone would show.

The Trio server reads body streams in turns (``ENCDISAGG_TRIO_READ_TURNS``, default 4;
the server inherits this process's environment): run with ``ENCDISAGG_TRIO_READ_TURNS=0``
for Hypercorn's own read loop, to compare. The setting used is recorded in the results.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
from _common import Options, headline, latency_summary, parse_options, write_json
from bench_server import HEIGHT, WIDTH, _Prober, burst_bodies, tiny_server

from encdisagg.server._asgi._read_turns import read_turns_from_env

FLAVOURS = ("asyncio", "trio")
RSS_GOAL_MIB = 2048.0
HEALTH_GOAL_MS = 100.0
SAMPLE_INTERVAL_S = 0.02
#: Longest pause before a retry, whatever ``Retry-After`` says (the figure is memory, not
#: the client's patience).
MAX_RETRY_PAUSE_S = 2.0
MAX_ATTEMPTS = 200


def _status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class _RssSampler:
    """Samples a process's resident memory from a thread of its own."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._stop = threading.Event()
        self.peak_kib = 0
        self.samples = 0
        self._thread = threading.Thread(target=self._run, name="rss sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = _status_kib(self._pid, "VmRSS")
            if rss is not None:
                self.peak_kib = max(self.peak_kib, rss)
                self.samples += 1
            self._stop.wait(SAMPLE_INTERVAL_S)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _retry_pause(response: httpx.Response) -> float:
    try:
        seconds = float(response.headers.get("Retry-After", "1"))
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.0), MAX_RETRY_PAUSE_S)


async def _burst(url: str, bodies: list[bytes], pid: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies))
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600.0) as client:
        (await client.get("/health")).raise_for_status()
        idle_rss = _status_kib(pid, "VmRSS")
        final: dict[str, int] = {}
        unavailable = {"answers": 0, "with_retry_after": 0}
        encode_s: list[float] = []

        async def one(index: int, body: bytes) -> None:
            start = time.perf_counter()
            for _ in range(MAX_ATTEMPTS):
                response = await client.post("/encode", content=body, headers=headers)
                if response.status_code != 503:
                    break
                unavailable["answers"] += 1
                if "Retry-After" in response.headers:
                    unavailable["with_retry_after"] += 1
                await anyio.sleep(_retry_pause(response))
            encode_s.append(time.perf_counter() - start)
            key = str(response.status_code)
            final[key] = final.get(key, 0) + 1
            await client.post("/release", json={"req_id": f"bench-{index}"})

        with _RssSampler(pid) as sampler, _Prober(url) as prober:
            start = time.perf_counter()
            async with anyio.create_task_group() as burst:
                for index, body in enumerate(bodies):
                    burst.start_soon(one, index, body)
            wall = time.perf_counter() - start
        peak_kib = _status_kib(pid, "VmHWM")
    return {
        "requests": len(bodies),
        "wall_s": wall,
        "idle_rss_mib": None if idle_rss is None else idle_rss / 1024,
        "peak_rss_mib": None if peak_kib is None else peak_kib / 1024,
        "sampled_peak_rss_mib": sampler.peak_kib / 1024,
        "rss_samples": sampler.samples,
        "final_statuses": final,
        "answers_503": unavailable["answers"],
        "answers_503_with_retry_after": unavailable["with_retry_after"],
        "encode_latency_with_retries": latency_summary(encode_s),
        "health_under_load": latency_summary(prober.latencies),
        "health_statuses": prober.statuses,
    }


def main(argv: list[str] | None = None) -> int:
    options: Options = parse_options(__doc__.splitlines()[0], argv)
    count, bodies, body_mib = burst_bodies(options)
    runs: dict[str, Any] = {}
    for flavour in FLAVOURS:
        with tiny_server(flavour) as server:
            print(f"{flavour}: {count} concurrent /encode against {server.url}", flush=True)
            runs[flavour] = anyio.run(_burst, server.url, bodies, server.pid, backend="asyncio")
        run = runs[flavour]
        print(
            f"{flavour}: peak RSS {run['peak_rss_mib']:.0f} MiB (idle {run['idle_rss_mib']:.0f}); "
            f"/health p99 {run['health_under_load']['p99_ms']:.1f} ms; "
            f"{run['answers_503']} answers 503; {run['wall_s']:.1f} s; {run['final_statuses']}",
            flush=True,
        )
    heads = []
    for flavour, run in runs.items():
        peak = run["peak_rss_mib"]
        p99 = run["health_under_load"]["p99_ms"]
        heads += [
            headline(
                f"peak RSS during {count} concurrent 1280x720 encodes ({flavour})",
                peak,
                "MiB",
                goal=f"< {RSS_GOAL_MIB:.0f} MiB",
                met=peak is not None and peak < RSS_GOAL_MIB,
                note=(
                    f"idle {run['idle_rss_mib']:.0f} MiB; {run['answers_503']} answers 503 "
                    f"(retried); final {run['final_statuses']}"
                ),
            ),
            headline(
                f"/health p99 during {count} concurrent 1280x720 encodes ({flavour}, memory run)",
                p99,
                "ms",
                goal=f"< {HEALTH_GOAL_MS:.0f} ms",
                met=p99 < HEALTH_GOAL_MS,
                note=f"p50 {run['health_under_load']['p50_ms']:.1f} ms",
            ),
        ]
    write_json(
        options,
        "hostile",
        {
            "what": "peak server RSS and /health latency during a burst of concurrent encodes",
            "image": f"{WIDTH}x{HEIGHT} PNG, {body_mib:.2f} MiB per request body",
            "model": "tiny (seeded Qwen2-VL architecture, CPU)",
            "concurrency": count,
            "trio_read_turns": read_turns_from_env(),
            "runs": runs,
            "headline": heads,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
