"""Encode latency of 1280x720 images with the global embedding cache: hit path vs miss path.

Run as ``python benchmarks/bench_cache.py [--quick] [--out DIR]``; writes ``cache.json``
(``benchmarks/results/`` by default). Needs ``mooncake_master`` and ``mooncake_client`` (the
``mooncake-cpu`` extra): it starts both on loopback, with the master's built-in HTTP
metadata server and one storage process lending the store 1 GiB.

Every request is one ``Encoder.encode`` of one PNG (1280x720, seeded noise, about 2.7 MB)
with the tiny model on CPU, timed from the call to its return (staged), one request at a
time; the request is released before the next one. Cases measured in one pass are
interleaved request by request (so drifting machine load touches them alike). Cases:

- ``no_cache``: an encoder without the cache (the baseline);
- ``miss``: an encoder with the global tier, every image new (key hash, one lookup round
  trip that misses, preprocess, forward, stage; the insert runs in the background);
- ``global_hit``: a second encoder instance (the local tier off) encoding the same images:
  every item is fetched from the store; no preprocess, no forward;
- ``local_hit``: an encoder with a local tier of 256 MiB in front, second pass;
- ``half_hit``: requests of two images, one cached and one new.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from PIL import Image

from encdisagg import Encoder, EncoderConfig, EncodeRequest
from encdisagg.models import QwenVisionModel, load_model

RESULTS = Path(__file__).resolve().parent / "results"
LOOPBACK = "127.0.0.1"
WIDTH, HEIGHT = 1280, 720


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def _binary(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(found).is_file():
        raise SystemExit(f"{name} not found: install the mooncake-cpu extra")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args!r} exited with {process.returncode}")
        try:
            socket.create_connection((LOOPBACK, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise SystemExit(f"nothing listens on {LOOPBACK}:{port}")


@contextmanager
def _spawn(argv: list[str], log: Path, port: int) -> Iterator[None]:
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait_port(port, process)
        yield
    finally:
        process.kill()
        process.wait(timeout=30)


@contextmanager
def store_on_loopback(logs: Path) -> Iterator[str]:
    """Start a master and a storage process; yield the encoders' ``global_cache`` URL."""
    rpc, meta, metrics, storage = (_free_port() for _ in range(4))
    with ExitStack() as stack:
        stack.enter_context(
            _spawn(
                [
                    _binary("mooncake_master"),
                    f"--rpc_address={LOOPBACK}",
                    f"--rpc_port={rpc}",
                    "--enable_http_metadata_server=true",
                    f"--http_metadata_server_host={LOOPBACK}",
                    f"--http_metadata_server_port={meta}",
                    f"--metrics_host={LOOPBACK}",
                    f"--metrics_port={metrics}",
                ],
                logs / "master.log",
                rpc,
            )
        )
        metadata_url = f"http://{LOOPBACK}:{meta}/metadata"
        stack.enter_context(
            _spawn(
                [
                    _binary("mooncake_client"),
                    f"--host={LOOPBACK}",
                    f"--port={storage}",
                    "--global_segment_size=1GB",
                    f"--master_server_address={LOOPBACK}:{rpc}",
                    f"--metadata_server={metadata_url}",
                    "--protocol=tcp",
                ],
                logs / "storage.log",
                storage,
            )
        )
        time.sleep(0.5)  # the storage process mounts its memory just after it listens
        yield (
            f"mooncake://{LOOPBACK}:{rpc}?metadata={metadata_url}"
            "&segment_mb=0&buffer_mb=64&timeout_ms=2000"
        )


def _summary(seconds: Sequence[float]) -> dict[str, float | int]:
    ordered = sorted(seconds)
    return {
        "n": len(ordered),
        "p50_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))] * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
        "min_ms": ordered[0] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


async def _timed(encoder: Encoder, items: list[object], req_id: str) -> float:
    start = time.perf_counter()
    await encoder.encode(EncodeRequest(req_id, items))
    elapsed = time.perf_counter() - start
    await encoder.release(req_id)
    return elapsed


async def _run(
    model: QwenVisionModel, url: str, images: list[bytes], fresh: list[bytes]
) -> dict[str, Any]:
    # Cases measured in the same pass are interleaved request by request, so a change in
    # the machine's load during the run touches each of them alike.
    times: dict[str, list[float]] = {
        name: [] for name in ("no_cache", "miss", "global_hit", "half_hit", "local_hit")
    }
    warm = [_png(10_000 + i) for i in range(2)]
    cases: dict[str, Any] = {}
    plain = Encoder(EncoderConfig(), model=model)
    first = Encoder(EncoderConfig(global_cache=url), model=model)
    async with plain, first:
        for index, image in enumerate(warm):
            await _timed(plain, [image], f"warm-{index}")
            await _timed(first, [image], f"warm-{index}")
        for index, image in enumerate(images):
            times["no_cache"].append(await _timed(plain, [image], f"plain-{index}"))
            times["miss"].append(await _timed(first, [image], f"miss-{index}"))
        assert first.global_cache is not None
        await first.global_cache.drain()
        inserts = first.global_cache.stats().inserts

    second = Encoder(EncoderConfig(global_cache=url), model=model)
    local = Encoder(EncoderConfig(global_cache=url, prefix_cache_mb=256), model=model)
    async with second, local:
        for index, image in enumerate(images):
            await _timed(local, [image], f"fill-{index}")
        for index, (image, new) in enumerate(zip(images, fresh, strict=True)):
            times["global_hit"].append(await _timed(second, [image], f"hit-{index}"))
            times["local_hit"].append(await _timed(local, [image], f"local-{index}"))
            times["half_hit"].append(await _timed(second, [image, new], f"half-{index}"))
        stats = second.global_cache_stats()
        assert stats is not None
    for name, seconds in times.items():
        cases[name] = _summary(seconds)
    cases["miss"]["inserts"] = inserts
    cases["global_hit"]["store_hits"] = stats.hits
    paired = [m - p for m, p in zip(times["miss"], times["no_cache"], strict=True)]
    cases["miss"]["overhead_vs_no_cache_p50_ms"] = statistics.median(paired) * 1e3
    return cases


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="few images, for a smoke run")
    parser.add_argument("--out", type=Path, help="folder for cache.json")
    args = parser.parse_args(argv)
    count = 4 if args.quick else 20
    out: Path = args.out or (RESULTS / "quick" if args.quick else RESULTS)

    model = load_model("tiny")
    images = [_png(seed) for seed in range(count)]
    fresh = [_png(1_000 + seed) for seed in range(count)]
    with tempfile.TemporaryDirectory() as logs, store_on_loopback(Path(logs)) as url:
        cases = anyio.run(_run, model, url, images, fresh)

    hit, miss = cases["global_hit"]["p50_ms"], cases["miss"]["p50_ms"]
    grid_tokens = model.preprocess([images[0]], "image").token_counts[0]
    data = {
        "benchmark": "cache",
        "quick": args.quick,
        "what": "Encoder.encode latency, one 1280x720 PNG per request, tiny model, CPU",
        "image": {"width": WIDTH, "height": HEIGHT, "png_bytes": len(images[0])},
        "tokens_per_image": grid_tokens,
        "embedding_bytes": grid_tokens * model.hidden_size * model.dtype.itemsize,
        "cases": cases,
        "speedup_hit_vs_miss_p50": miss / hit,
        "cache_overhead_on_miss_p50_ms": cases["miss"]["overhead_vs_no_cache_p50_ms"],
        "headline": [
            {
                "figure": "global cache hit, 1280x720 encode p50",
                "value": hit,
                "unit": "ms",
                "goal": None,
                "met": None,
                "note": "second encoder instance; store on loopback",
            },
            {
                "figure": "global cache miss, 1280x720 encode p50",
                "value": miss,
                "unit": "ms",
                "goal": None,
                "met": None,
                "note": f"no cache: {cases['no_cache']['p50_ms']:.1f} ms",
            },
            {
                "figure": "global cache hit speed-up (p50)",
                "value": miss / hit,
                "unit": "x",
                "goal": None,
                "met": None,
                "note": "",
            },
        ],
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": _version("torch"),
            "mooncake": _version("mooncake-transfer-engine-non-cuda")
            or _version("mooncake-transfer-engine"),
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cache.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    for name, case in cases.items():
        p50, p90, n = case["p50_ms"], case["p90_ms"], case["n"]
        print(f"{name:>10}: p50 {p50:8.2f} ms  p90 {p90:8.2f} ms  (n={n})")
    print(f"hit vs miss (p50): {miss / hit:.1f}x; wrote {path}")


if __name__ == "__main__":
    main()
