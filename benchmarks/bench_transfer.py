"""Transfer efficiency: staged embeddings delivered by the Encoder vs a raw loop.

Run as ``python benchmarks/bench_transfer.py [--quick]``; writes ``transfer.json`` and
``transfer.png``.

For 1, 8 and 64 MiB embeddings (``NullVisionModel`` with hidden size 4096 in float16, so the
model costs nothing and the embedding has exactly the wanted size), on each transport:

- **Mooncake TCP**: the receiver is a child process holding a registered buffer. *Raw*: one
  registered source buffer and a loop of ``transfer_sync_write`` calls on a bare
  ``mooncake.engine.TransferEngine``. *Encoder*: N embeddings staged (and registered) by
  ``Encoder.encode``, then N sequential ``Encoder.send`` calls to a ``MooncakeDestination``;
  each send returns once the write finished and the request was released (its region
  deregistered), so the time covers the whole delivery.
- **ZMQ**: the receiver is a child process with a plain PULL socket that acknowledges each
  message. *Raw*: a bare pyzmq PUSH socket sending ``[header, memoryview]`` zero-copy.
  *Encoder*: N staged embeddings sent by ``Encoder.send`` to a ``ZmqDestination``. Two modes:
  *sequential* (one message at a time: raw waits for ZMQ's tracker, the Encoder awaits each
  send) and *pipelined* (raw queues all N without waiting; the Encoder runs N sends at once).
  The clock stops when the receiver acknowledged all N.

A second raw loop on each transport sends N *distinct* buffers (filled, and for Mooncake
registered, before the clock starts) instead of one: the Encoder sends a different embedding
each time, and re-reading one buffer that stays in the CPU caches is faster than reading N
that do not. The headline ratio is against the one-buffer loop (the stricter); the ratio
against the distinct-buffer loop is reported beside it.

Only delivery is timed (encodes happen before the clock starts). Raw and Encoder runs
alternate, repeated; throughput is the median over repeats (best kept too), and the ratio
Encoder / raw is taken from the medians. The goal is a ratio of at least 0.8.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from typing import Any

from _common import (
    MIB,
    Options,
    child,
    headline,
    label_bars,
    parse_options,
    spread,
    tempfile_log,
    write_json,
    write_png,
)

HIDDEN = 4096
BYTES_PER_TOKEN = HIDDEN * 2  # float16
GOAL = 0.8


# -- receivers (child processes) -----------------------------------------------------------


def _mooncake_peer(capacity: int) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"mooncake initialize failed (rc={rc})")
    buffer = (ctypes.c_uint8 * capacity)()
    ptr = ctypes.addressof(buffer)
    rc = engine.register_memory(ptr, capacity)
    if rc != 0:
        raise SystemExit(f"mooncake register_memory failed (rc={rc})")
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "ptr": ptr}), flush=True)
    sys.stdin.readline()
    engine.unregister_memory(ptr)


def _zmq_peer(ack_url: str) -> None:
    import zmq

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ack = context.socket(zmq.PUSH)
    ack.setsockopt(zmq.LINGER, 0)
    ack.connect(ack_url)
    print(json.dumps({"url": f"tcp://127.0.0.1:{port}"}), flush=True)
    while True:
        frames = pull.recv_multipart(copy=False)
        if len(frames) == 1 and bytes(frames[0].buffer) == b"quit":
            break
        ack.send(str(len(frames[-1].buffer)).encode())
    pull.close()
    ack.close()
    context.term()


def _start_peer(kind: str, arg: str) -> tuple[subprocess.Popen[str], dict[str, Any], Any]:
    errors = tempfile_log()
    process = child([__file__, "--peer", kind, arg], stderr=errors)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(10)
        errors.seek(0)
        raise RuntimeError(f"the {kind} receiver did not start:\n{errors.read()[-2000:]}")
    return process, json.loads(line), errors


def _stop_peer(process: subprocess.Popen[str], errors: Any) -> None:
    try:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(15)
    except (OSError, subprocess.TimeoutExpired):
        process.kill()
        process.wait(5)
    errors.close()


# -- the measurement ---------------------------------------------------------------------------


def _sizes(options: Options) -> list[tuple[int, int]]:
    """(MiB, messages per repeat) pairs: about 256 MiB per repeat (32 MiB when quick)."""
    if options.quick:
        return [(1, 16), (8, 4)]
    return [(1, 128), (8, 32), (64, 6)]


def _encoder(model_tokens: int, transfer: str) -> Any:
    import torch

    from encdisagg import Encoder, EncoderConfig
    from encdisagg.models import NullVisionModel

    config = EncoderConfig(
        transfer=transfer,
        max_batch_size=1,
        request_timeout_s=120.0,
        send_timeout_s=600.0,
        zmq_send_timeout_s=120.0,
    )
    model = NullVisionModel(hidden_size=HIDDEN, tokens_per_item=model_tokens, dtype=torch.float16)
    return Encoder(config, model=model)


async def _stage(encoder: Any, prefix: str, count: int) -> list[str]:
    from encdisagg import EncodeRequest

    rids = [f"{prefix}-{index}" for index in range(count)]
    for rid in rids:
        await encoder.encode(EncodeRequest(rid, [rid]))
    return rids


def _mooncake_raw(engine: Any, session: str, remote: int, local: int, size: int, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        rc = engine.transfer_sync_write(session, local, remote, size)
        if rc != 0:
            raise RuntimeError(f"raw transfer_sync_write failed (rc={rc})")
    return size * n / (time.perf_counter() - start)


def _mooncake_raw_distinct(engine: Any, session: str, remote: int, sources: list[Any]) -> float:
    """Raw, but each message from its own buffer (all registered before the clock starts), as
    the Encoder sends a distinct embedding each time: the one-buffer loop re-reads memory
    that stays in the CPU caches, which N distinct embeddings do not."""
    size = sources[0].nbytes
    for source in sources:
        if engine.register_memory(source.ctypes.data, size) != 0:
            raise RuntimeError("raw register_memory failed")
    try:
        start = time.perf_counter()
        for source in sources:
            rc = engine.transfer_sync_write(session, source.ctypes.data, remote, size)
            if rc != 0:
                raise RuntimeError(f"raw transfer_sync_write failed (rc={rc})")
        return size * len(sources) / (time.perf_counter() - start)
    finally:
        for source in sources:
            engine.unregister_memory(source.ctypes.data)


def _distinct_sources(size: int, n: int, seed: int) -> list[Any]:
    import numpy as np

    # Filled, so their pages exist, before the clock starts.
    return [np.full(size, (seed + index) % 256, dtype=np.uint8) for index in range(n)]


async def _run_mooncake(options: Options, repeats: int) -> dict[str, Any]:
    import numpy as np
    from mooncake.engine import TransferEngine

    from encdisagg import MooncakeDestination

    sizes = _sizes(options)
    capacity = max(mib for mib, _ in sizes) * MIB
    process, peer, errors = _start_peer("mooncake", str(capacity))
    session, remote = peer["session"], peer["ptr"]
    raw_engine = TransferEngine()
    if raw_engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    source = np.random.default_rng(0).integers(0, 256, capacity, dtype=np.uint8)
    local = source.ctypes.data
    if raw_engine.register_memory(local, capacity) != 0:
        raise RuntimeError("mooncake register_memory failed")
    results: list[dict[str, Any]] = []
    try:
        for mib, n in sizes:
            size = mib * MIB
            destination = MooncakeDestination(session, remote, "receiver:1")
            raw: list[float] = []
            distinct: list[float] = []
            wrapped: list[float] = []
            async with _encoder(size // BYTES_PER_TOKEN, "mooncake") as encoder:
                # Warm-up: the first write pays the handshake.
                _mooncake_raw(raw_engine, session, remote, local, size, 1)
                (rid,) = await _stage(encoder, f"warm-{mib}", 1)
                await encoder.send(rid, destination)
                for repeat in range(repeats):
                    raw.append(_mooncake_raw(raw_engine, session, remote, local, size, n))
                    sources = _distinct_sources(size, n, repeat)
                    distinct.append(_mooncake_raw_distinct(raw_engine, session, remote, sources))
                    del sources
                    rids = await _stage(encoder, f"mc-{mib}-{repeat}", n)
                    start = time.perf_counter()
                    for rid in rids:
                        await encoder.send(rid, destination)
                    wrapped.append(size * n / (time.perf_counter() - start))
                    stats = encoder.stats()
                    assert stats.live_requests == 0, stats
                    assert stats.registered_regions == 0, stats
            row = _row("mooncake", "sequential", mib, n, raw, wrapped)
            _add_distinct(row, distinct)
            results.append(row)
            print(_line(results[-1]))
    finally:
        raw_engine.unregister_memory(local)
        del raw_engine
        _stop_peer(process, errors)
    return {"rows": results}


def _ack_wait(ack: Any, n: int) -> None:
    import zmq

    for _ in range(n):
        if not ack.poll(120_000, zmq.POLLIN):
            raise RuntimeError("the ZMQ receiver stopped acknowledging")
        ack.recv()


async def _run_zmq(options: Options, repeats: int) -> dict[str, Any]:
    import anyio
    import msgpack
    import numpy as np
    import zmq

    from encdisagg import ZmqDestination

    context = zmq.Context()
    ack = context.socket(zmq.PULL)
    ack.setsockopt(zmq.LINGER, 0)
    ack_port = ack.bind_to_random_port("tcp://127.0.0.1")
    process, peer, errors = _start_peer("zmq", f"tcp://127.0.0.1:{ack_port}")
    url = peer["url"]
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 16)  # as the Encoder's push pool
    push.connect(url)
    results: list[dict[str, Any]] = []
    sizes = _sizes(options)
    capacity = max(mib for mib, _ in sizes) * MIB
    source = np.random.default_rng(0).integers(0, 256, capacity, dtype=np.uint8)

    def raw(size: int, n: int, pipelined: bool, sources: list[Any] | None = None) -> float:
        header = msgpack.packb(
            {"v": 1, "req_id": "raw", "shape": [size // BYTES_PER_TOKEN, HIDDEN]}
        )
        payloads = [memoryview(buf) for buf in sources] if sources else [memoryview(source[:size])]
        start = time.perf_counter()
        trackers = []
        for index in range(n):
            payload = payloads[index % len(payloads)]
            tracker = push.send_multipart([header, payload], copy=False, track=True)
            if pipelined:
                trackers.append(tracker)
            else:
                tracker.wait()
        for tracker in trackers:
            tracker.wait()
        _ack_wait(ack, n)
        return size * n / (time.perf_counter() - start)

    try:
        for mib, n in sizes:
            size = mib * MIB
            destination = ZmqDestination(url)
            async with _encoder(size // BYTES_PER_TOKEN, "zmq") as encoder:
                raw(size, 1, False)
                (rid,) = await _stage(encoder, f"warm-{mib}", 1)
                await encoder.send(rid, destination)
                _ack_wait(ack, 1)
                for mode in ("sequential", "pipelined"):
                    raws: list[float] = []
                    distinct: list[float] = []
                    wrapped: list[float] = []
                    for repeat in range(repeats):
                        raws.append(raw(size, n, mode == "pipelined"))
                        sources = _distinct_sources(size, n, repeat)
                        distinct.append(raw(size, n, mode == "pipelined", sources))
                        del sources
                        rids = await _stage(encoder, f"zmq-{mib}-{mode}-{repeat}", n)
                        start = time.perf_counter()
                        if mode == "sequential":
                            for rid in rids:
                                await encoder.send(rid, destination)
                        else:
                            async with anyio.create_task_group() as group:
                                for rid in rids:
                                    group.start_soon(encoder.send, rid, destination)
                        _ack_wait(ack, n)
                        wrapped.append(size * n / (time.perf_counter() - start))
                        assert encoder.stats().live_requests == 0, encoder.stats()
                    row = _row("zmq", mode, mib, n, raws, wrapped)
                    _add_distinct(row, distinct)
                    results.append(row)
                    print(_line(results[-1]))
    finally:
        push.send(b"quit")
        _stop_peer(process, errors)
        push.close()
        ack.close()
        context.term()
    return {"rows": results}


def _add_distinct(row: dict[str, Any], distinct: list[float]) -> None:
    row["raw_distinct_gb_s"] = spread([x / 1e9 for x in distinct])
    row["ratio_vs_distinct_median"] = float(row["encoder_gb_s"]["median"]) / float(
        row["raw_distinct_gb_s"]["median"]
    )


def _row(
    transport: str, mode: str, mib: int, n: int, raw: list[float], wrapped: list[float]
) -> dict[str, Any]:
    raw_s = spread([x / 1e9 for x in raw])
    enc_s = spread([x / 1e9 for x in wrapped])
    ratio = float(enc_s["median"]) / float(raw_s["median"])
    return {
        "transport": transport,
        "mode": mode,
        "size_mib": mib,
        "messages_per_repeat": n,
        "raw_gb_s": raw_s,
        "encoder_gb_s": enc_s,
        "ratio_median": ratio,
        "ratio_best": float(enc_s["max"]) / float(raw_s["max"]),
        "met": ratio >= GOAL,
    }


def _line(row: dict[str, Any]) -> str:
    distinct = row["raw_distinct_gb_s"]["median"]
    return (
        f"{row['transport']:>8} {row['mode']:>10} {row['size_mib']:>3} MiB: raw "
        f"{row['raw_gb_s']['median']:.2f} GB/s (distinct buffers {distinct:.2f})"
        + f", encoder {row['encoder_gb_s']['median']:.2f} GB/s, ratio {row['ratio_median']:.2f}"
    )


def _plot(options: Options, rows: list[dict[str, Any]]) -> None:
    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        labels = [f"{r['transport']}\n{r['mode']}\n{r['size_mib']} MiB" for r in rows]
        xs = list(range(len(rows)))
        width = 0.38
        raw = ax.bar(
            [x - width / 2 for x in xs],
            [r["raw_gb_s"]["median"] for r in rows],
            width,
            label="raw loop",
            color="#999999",
        )
        enc = ax.bar(
            [x + width / 2 for x in xs],
            [r["encoder_gb_s"]["median"] for r in rows],
            width,
            label="through the Encoder",
            color="#3b75af",
        )
        label_bars(ax, raw, "{:.2f}")
        label_bars(ax, enc, "{:.2f}")
        for x, r in zip(xs, rows, strict=True):
            ax.annotate(
                f"{r['ratio_median']:.2f}x",
                (x, 0),
                ha="center",
                va="bottom",
                fontsize=8,
                color="green" if r["met"] else "red",
                xytext=(0, 3),
                textcoords="offset points",
            )
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_ylabel("GB/s (median of repeats)")
        ax.set_title(f"Staged-embedding delivery vs raw transport (goal: >= {GOAL}x)")
        ax.legend(fontsize=8)

    write_png(options, "transfer", draw, size=(11, 4.5))


async def _main(options: Options) -> dict[str, Any]:
    repeats = options.repeats or options.pick(5, 2)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        notes.append(f"Mooncake not measured: {exc}")
    else:
        rows += (await _run_mooncake(options, repeats))["rows"]
    rows += (await _run_zmq(options, repeats))["rows"]
    return {"rows": rows, "repeats": repeats, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--peer"]:
        kind, arg = args[1], args[2]
        if kind == "mooncake":
            _mooncake_peer(int(arg))
        else:
            _zmq_peer(arg)
        return 0
    import anyio

    options = parse_options(__doc__.splitlines()[0], args)
    data = anyio.run(_main, options)
    heads = []
    for row in data["rows"]:
        if row["transport"] == "zmq" and row["mode"] != "pipelined":
            continue
        heads.append(
            headline(
                f"transfer {row['transport']} {row['size_mib']} MiB: Encoder / raw",
                row["ratio_median"],
                "x",
                goal=f">= {GOAL}x",
                met=row["met"],
                note=(
                    f"{row['encoder_gb_s']['median']:.2f} vs {row['raw_gb_s']['median']:.2f} GB/s"
                    + (f", {row['mode']}" if row["transport"] == "zmq" else "")
                    + f"; {row['ratio_vs_distinct_median']:.2f}x raw over distinct buffers"
                ),
            )
        )
    data["headline"] = heads
    write_json(options, "transfer", data)
    _plot(options, data["rows"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
