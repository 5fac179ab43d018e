"""Fleet: requests per second through an etcd-discovered encoder fleet of 1, 2 and 3
encoders, and the time from an encoder host's death to its removal from routing.

Run as ``python benchmarks/bench_fleet.py [--quick]``; writes ``fleet.json`` and ``fleet.png``.
Needs etcd (Debian's ``etcd-server`` package); without it the run records why it skipped.

A real etcd runs on 127.0.0.1. Each encoder is an ``encdisagg serve --model null --registry
...`` process in a process group of its own, bound to its own loopback address (127.0.0.2,
.3, .4 where they can be bound); this process is the one prefill, bound to 127.0.0.5: an
``EncoderClient(registry=...)`` and a ZMQ ``EmbeddingReceiver``, ``C`` tasks fetching
single-item requests with ``fetch_from_fleet`` back to back. Encoders are added one at a
time; each fleet size is measured for ``D`` seconds after a warm-up.

Then, with three encoders and the traffic still running, one host's process group is
killed (SIGKILL): the figures are the time until the client stops routing to it (the first
call that fails there marks it suspect) and until etcd removes its key (its lease expires;
the watch delivers the delete), with the server's default 5 s lease. The killed host is
started again before the next kill. Requests failed over meanwhile are counted; none may
fail.

The null model costs nothing, so the encoders are never the bottleneck here: on a machine
with fewer cores than processes, each encoder added takes CPU from the one prefill, and the
rate measures what routing and delivery cost, not what a fleet of real encoders gains.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import suppress
from typing import Any

from _common import Options, headline, latency_summary, parse_options, write_json, write_png

NAME = "fleet"
CONCURRENCY = 16
LEASE_TTL_S = 5
PREFILL_HOST = "127.0.0.5"
ENCODER_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
ANNOUNCEMENT = "encdisagg serving on "


def _bindable(host: str) -> bool:
    try:
        with socket.socket() as sock:
            sock.bind((host, 0))
    except OSError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def etcd_or_skip(options: Options, name: str) -> str | None:
    """The etcd binary; without one, the benchmark ``name`` is written as skipped (saying
    why) and ``None`` is returned."""
    binary = shutil.which("etcd")
    if binary is None:
        reason = "etcd is not installed (Debian's etcd-server package)"
        print(f"skipped: {reason}")
        write_json(options, name, {"skipped": reason, "headline": []})
    return binary


class Etcd:
    """etcd on loopback with a temporary data dir, for the run."""

    def __init__(self, binary: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="bench-fleet-etcd-")
        client, peer = _free_port(), _free_port()
        self.endpoint = f"127.0.0.1:{client}"
        self.process = subprocess.Popen(
            [
                binary,
                "--name=bench",
                f"--data-dir={self._dir.name}/data",
                f"--listen-client-urls=http://{self.endpoint}",
                f"--advertise-client-urls=http://{self.endpoint}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=bench=http://127.0.0.1:{peer}",
                "--log-level=error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/version", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.close()
                    raise RuntimeError("etcd did not start") from None
                time.sleep(0.05)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self._dir.cleanup()


class Host:
    """One encoder host: ``encdisagg serve`` in its own process group."""

    def __init__(self, address: str, registry: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "encdisagg",
                "serve",
                "--model=null",
                f"--host={address}",
                "--port=0",
                f"--registry={registry}",
                f"--registry-lease-ttl={LEASE_TTL_S}",
                "--log-level=warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self.url = ""
        for line in self.process.stdout:
            if line.startswith(ANNOUNCEMENT):
                self.url = line[len(ANNOUNCEMENT) :].strip()
                break
        self.process.stdout.close()
        if not self.url:
            self.kill()
            raise RuntimeError(f"encdisagg serve on {address} did not start")

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


async def _traffic(client: Any, receiver: Any, seconds: float, counts: dict[str, Any]) -> None:
    import anyio

    from encdisagg.receiver import fetch_from_fleet

    deadline = anyio.current_time() + seconds

    async def worker(index: int) -> None:
        n = 0
        while anyio.current_time() < deadline:
            rid = f"{counts['tag']}-{index}-{n}"
            n += 1
            start = time.perf_counter()
            try:
                async with fetch_from_fleet(client, receiver, rid, {"image": [rid]}, timeout_s=30):
                    pass
            except Exception as exc:
                counts["failed"] += 1
                counts["errors"].append(repr(exc)[:200])
                continue
            counts["latencies"].append(time.perf_counter() - start)

    async with anyio.create_task_group() as group:
        for index in range(CONCURRENCY):
            group.start_soon(worker, index)


async def _observe(fleet: Any, url: str, killed_at: float, timings: dict[str, float]) -> None:
    """Record when ``url`` is first suspected (a call to it failed) and when it left the view."""
    import anyio

    view = fleet.view
    while url in view:
        if "suspected_s" not in timings and fleet.is_suspect(url):
            timings["suspected_s"] = anyio.current_time() - killed_at
        # Suspicion is no event of the view: look again every 5 ms meanwhile.
        with anyio.move_on_after(0.005):
            await view.wait_changed()
    timings["removed_s"] = view.left_at[url] - killed_at
    timings.setdefault("suspected_s", timings["removed_s"])


def _counts(tag: str) -> dict[str, Any]:
    return {"tag": tag, "failed": 0, "errors": [], "latencies": []}


async def _run(options: Options, registry: str, addresses: list[str]) -> dict[str, Any]:
    import anyio
    import anyio.to_thread
    import httpx

    from encdisagg.models import NullVisionModel
    from encdisagg.receiver import EmbeddingReceiver, EncoderClient, EncoderFleet

    measure_s = options.pick(10, 3)
    warmup_s = options.pick(2, 1)
    kills = options.repeats or options.pick(3, 1)
    prefill = PREFILL_HOST if _bindable(PREFILL_HOST) else "127.0.0.1"
    model = NullVisionModel()
    fleet = EncoderFleet(
        registry, model="null", transport=httpx.AsyncHTTPTransport(local_address=prefill)
    )
    receiver = EmbeddingReceiver(
        transport="zmq",
        hidden_size=model.hidden_size,
        dtype=model.dtype,
        bind=f"tcp://{prefill}:0",
    )
    hosts: list[Host] = []
    sizes: list[dict[str, Any]] = []
    deaths: list[dict[str, Any]] = []
    try:
        async with (
            EncoderClient(
                registry=fleet, transport=httpx.AsyncHTTPTransport(local_address=prefill)
            ) as client,
            receiver,
        ):
            for size, address in enumerate(addresses, start=1):
                hosts.append(await anyio.to_thread.run_sync(Host, address, registry))
                with anyio.fail_after(30):
                    await fleet.wait_for(size)
                await _traffic(client, receiver, warmup_s, _counts(f"warm{size}"))
                counts = _counts(f"n{size}")
                started = time.perf_counter()
                await _traffic(client, receiver, measure_s, counts)
                elapsed = time.perf_counter() - started
                sizes.append(
                    {
                        "encoders": size,
                        "requests_per_s": len(counts["latencies"]) / elapsed,
                        "requests": len(counts["latencies"]),
                        "failed": counts["failed"],
                        "latency": latency_summary(counts["latencies"]),
                    }
                )
                print(f"{size} encoder(s): {sizes[-1]['requests_per_s']:.0f} req/s", flush=True)
            for kill in range(kills):
                victim = hosts[kill % len(hosts)]
                counts = _counts(f"kill{kill}")
                timings: dict[str, float] = {}

                async with anyio.create_task_group() as group:
                    group.start_soon(_traffic, client, receiver, LEASE_TTL_S + 3.0, counts)
                    await anyio.sleep(1.0)
                    killed_at = anyio.current_time()
                    await anyio.to_thread.run_sync(victim.kill)
                    with anyio.fail_after(LEASE_TTL_S + 10):
                        await _observe(fleet, victim.url, killed_at, timings)
                deaths.append({**timings, "failed": counts["failed"], "url": victim.url})
                print(f"kill {kill}: {timings}", flush=True)
                address = victim.url.split("//")[1].rsplit(":", 1)[0]
                hosts[kill % len(hosts)] = await anyio.to_thread.run_sync(Host, address, registry)
                with anyio.fail_after(30):
                    await fleet.wait_for(len(hosts))
    finally:
        for host in hosts:
            host.kill()
    return {"sizes": sizes, "deaths": deaths, "measure_s": measure_s, "prefill_host": prefill}


def _plot(options: Options, data: dict[str, Any]) -> None:
    sizes = data["sizes"]
    deaths = data["deaths"]

    def draw(fig: Any) -> None:
        left, right = fig.subplots(1, 2)
        xs = [row["encoders"] for row in sizes]
        left.bar(xs, [row["requests_per_s"] for row in sizes], color="#4c72b0")
        left.set_xticks(xs)
        left.set_xlabel("encoders in the fleet")
        left.set_ylabel("requests / s (one prefill, c=16)")
        runs = list(range(1, len(deaths) + 1))
        right.plot(runs, [d["suspected_s"] for d in deaths], "o-", label="client stops routing")
        right.plot(runs, [d["removed_s"] for d in deaths], "s-", label="lease expiry removes key")
        right.set_xticks(runs)
        right.set_xlabel("host killed (run)")
        right.set_ylabel("seconds after SIGKILL")
        right.legend(fontsize=7)
        fig.suptitle(f"etcd-discovered fleet, null model, lease {LEASE_TTL_S} s")

    write_png(options, NAME, draw, size=(10, 4))


def main(argv: list[str] | None = None) -> int:
    options = parse_options(__doc__.splitlines()[0], argv)
    binary = etcd_or_skip(options, NAME)
    if binary is None:
        return 0
    addresses = [h for h in ENCODER_HOSTS if _bindable(h)] or ["127.0.0.1"] * 3
    import anyio

    etcd = Etcd(binary)
    try:
        registry = f"etcd://{etcd.endpoint}/bench-fleet/"
        data = anyio.run(_run, options, registry, addresses, backend="asyncio")
    finally:
        etcd.close()
    sizes, deaths = data["sizes"], data["deaths"]
    one = sizes[0]["requests_per_s"]
    heads = [
        headline(
            f"fleet throughput, {row['encoders']} encoder(s)",
            row["requests_per_s"],
            "req/s",
            note=(
                f"{row['requests_per_s'] / one:.2f}x one encoder; p50 "
                f"{row['latency']['p50_ms']:.1f} ms, p99 {row['latency']['p99_ms']:.1f} ms"
            ),
        )
        for row in sizes
    ]
    if deaths:
        heads.append(
            headline(
                "fleet: host death to removal from routing",
                statistics.median(d["suspected_s"] for d in deaths),
                "s",
                note=(
                    f"first failed call marks it suspect; the lease ({LEASE_TTL_S} s) removes "
                    f"its key after {statistics.median(d['removed_s'] for d in deaths):.2f} s "
                    f"(median of {len(deaths)}); "
                    f"{sum(d['failed'] for d in deaths)} requests failed"
                ),
            )
        )
    data["headline"] = heads
    data["lease_ttl_s"] = LEASE_TTL_S
    data["concurrency"] = CONCURRENCY
    write_json(options, NAME, data)
    _plot(options, data)
    print(json.dumps(heads, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
