"""Transfer efficiency: Encoder delivery throughput / raw loop throughput, same transport.

Run as ``python benchmarks/bench_transfer.py [--quick] [--repeats PAIRS]`` (5 pairs, 3 when
quick); writes ``transfer.json`` and ``transfer.png``.

For 1, 8 and 64 MiB embeddings (``NullVisionModel`` with hidden size 4096 in float16, so the
model costs nothing and the embedding has exactly the wanted size), on each transport, a raw
loop and the Encoder deliver N messages to the same receiver, a child process:

- **Mooncake TCP** over loopback, from an engine in this process to the receiver's engine in
  the child, which holds a registered buffer. *Raw*: one registered source buffer and a loop of
  ``transfer_sync_write`` calls on a bare ``mooncake.engine.TransferEngine``. *Encoder*: N
  embeddings staged by ``Encoder.encode``, then N sequential ``Encoder.send`` calls to a
  ``MooncakeDestination``; each send returns once the write finished and the request was
  released, so the time covers the whole delivery.
- **ZMQ**: the receiver has a plain PULL socket and acknowledges each message. *Raw*: a bare
  pyzmq PUSH socket (no ``ZmqPushPool``) sending ``[header, memoryview]`` zero-copy.
  *Encoder*: N staged embeddings sent by ``Encoder.send`` to a ``ZmqDestination``. Two modes:
  *sequential* (one message at a time: raw waits for ZMQ's tracker, the Encoder awaits each
  send) and *pipelined* (raw queues all N without waiting; the Encoder runs N sends at once).
  The clock stops when the receiver acknowledged all N.

The Encoder is driven through its public API alone (``Encoder``, ``EncoderConfig``,
``EncodeRequest``, the destinations, ``stats()``); only delivery is timed (the encodes happen
before the clock starts). Once each Encoder is open the process freezes what is alive
(``gc.collect(); gc.freeze()``, untimed), as ``encdisagg serve`` does and docs/library.md
advises: otherwise a full pass of the cyclic collector over the few hundred thousand objects
torch and transformers leave alive (about 0.15 s) lands in some timed runs and not others.

Raw and Encoder runs are measured side by side in **pairs**, one pair per repeat, in one run;
the order inside a pair alternates (raw first, then Encoder first) so neither side always
finds the caches and the receiver warmed by the other. A pair's ratio is Encoder / raw
throughput; the **transfer efficiency** is the median of the pairs' ratios. The goal is at
least 0.9.

The raw Mooncake loop blocks its thread in ``transfer_sync_write``, which spins a core until
the write is done. An event loop cannot make that call itself; the Encoder submits each
write (``MooncakeEngine.write_async``: ``transfer_submit_write`` on the event loop) and
checks its status once per turn of the loop, yielding in between, so the loop's thread is
as busy as the raw loop's while a write runs; a write still running after 0.1 s goes to an
engine-owned thread that polls every such write and wakes its task. Each Mooncake pair also
times two more loops beside raw: ``mooncake_raw_hopped``, each ``transfer_sync_write`` in a
worker thread (``anyio.to_thread.run_sync``), which is how the Encoder made its writes
before; and ``mooncake_submit_poll``, each write submitted and its status checked once per
turn of the event loop with nothing else (no checks, no cancellation shield, no
bookkeeping), the least an async sender that waits for each write does. Their ratios to
raw, and the Encoder's ratio to each, are reported beside the headline.
The wait for ZMQ to release a zero-copy payload needs no thread: the payload view's
finalizer wakes the send.

Each ZMQ pair also times a sender with one task per message (``_transfer_raw``): every send
queues its message without blocking and returns once the payload view's finalizer says ZMQ
let go, and nothing else happens (no deadline, no checks, no bookkeeping). That is the least
an async sender whose sends each return on the release does; the raw loop is woken by no
message at all. Its ratio to raw, and the Encoder's ratio to it, are reported beside the
headline.

Another loop beside each pair's raw one sends N *distinct* buffers (filled, and for Mooncake
registered, before its clock starts): the Encoder sends a different embedding each time, and
re-reading one buffer that stays in the CPU caches is faster than reading N that do not. The
headline efficiency is against the one-buffer loop (the stricter); the one against the
distinct-buffer loop is reported beside it.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from _common import (
    MIB,
    Options,
    headline,
    label_bars,
    parse_options,
    spread,
    write_json,
    write_png,
)
from _transfer_peers import ack_wait, start_peer, stop_peer
from _transfer_raw import (
    ZmqRawSender,
    distinct_sources,
    mooncake_raw,
    mooncake_raw_distinct,
    mooncake_raw_hopped,
    mooncake_submit_poll,
)

HIDDEN = 4096
BYTES_PER_TOKEN = HIDDEN * 2  # float16
GOAL = 0.9


# -- the measurement ---------------------------------------------------------------------------


def _sizes(options: Options) -> list[tuple[int, int]]:
    """(MiB, messages per run): about 256 MiB per run (16 to 128 MiB when quick)."""
    if options.quick:
        return [(1, 16), (8, 4), (64, 2)]
    return [(1, 128), (8, 32), (64, 6)]


def _raw_first(pair: int) -> bool:
    """Even pairs run the raw loop first, odd pairs the Encoder."""
    return pair % 2 == 0


@asynccontextmanager
async def _encoder(model_tokens: int, transfer: str) -> AsyncIterator[Any]:
    """An open Encoder, in a process whose startup heap is frozen: as ``encdisagg serve``
    runs it, and as docs/library.md advises for any long-running process (untimed)."""
    import torch

    from encdisagg import Encoder, EncoderConfig
    from encdisagg.models import NullVisionModel

    config = EncoderConfig(
        transfer=transfer, max_batch_size=1, request_timeout_s=120.0, send_timeout_s=600.0
    )
    model = NullVisionModel(hidden_size=HIDDEN, tokens_per_item=model_tokens, dtype=torch.float16)
    async with Encoder(config, model=model) as encoder:
        gc.collect()
        gc.freeze()
        yield encoder


async def _stage(encoder: Any, prefix: str, count: int) -> list[str]:
    from encdisagg import EncodeRequest

    rids = [f"{prefix}-{index}" for index in range(count)]
    for rid in rids:
        await encoder.encode(EncodeRequest(rid, [rid]))
    return rids


async def _check_released(encoder: Any) -> None:
    """After a timed run: every request delivered and released (bounded wait, untimed)."""
    import anyio

    with anyio.move_on_after(30):
        while True:
            stats = encoder.stats()
            if not (stats.live_requests or stats.staged_bytes or stats.inflight_transfers):
                return
            await anyio.sleep(0.01)
    raise RuntimeError(f"the Encoder still holds requests after delivering: {encoder.stats()}")


async def _run_mooncake(options: Options, pairs: int) -> dict[str, Any]:
    import numpy as np
    from mooncake.engine import TransferEngine

    sizes = _sizes(options)
    capacity = max(mib for mib, _ in sizes) * MIB
    process, peer, errors = start_peer("mooncake", str(capacity))
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
            results.append(
                await _mooncake_size(raw_engine, session, remote, local, mib * MIB, n, pairs)
            )
            print(_line(results[-1]), flush=True)
    finally:
        raw_engine.unregister_memory(local)
        del raw_engine
        stop_peer(process, errors)
    return {"rows": results}


async def _mooncake_size(
    raw_engine: Any, session: str, remote: int, local: int, size: int, n: int, pairs: int
) -> dict[str, Any]:
    from encdisagg import MooncakeDestination

    destination = MooncakeDestination(session, remote, "receiver:1")
    raw: list[float] = []
    distinct: list[float] = []
    hopped: list[float] = []
    polled: list[float] = []
    wrapped: list[float] = []

    async def run_raw(pair: int) -> None:
        raw.append(mooncake_raw(raw_engine, session, remote, local, size, n))
        sources = distinct_sources(size, n, pair)
        distinct.append(mooncake_raw_distinct(raw_engine, session, remote, sources))
        hopped.append(await mooncake_raw_hopped(raw_engine, session, remote, local, size, n))
        polled.append(await mooncake_submit_poll(raw_engine, session, remote, local, size, n))

    async with _encoder(size // BYTES_PER_TOKEN, "mooncake") as encoder:
        # Warm-up: the first write pays the handshake.
        mooncake_raw(raw_engine, session, remote, local, size, 1)
        (rid,) = await _stage(encoder, f"warm-{size}", 1)
        await encoder.send(rid, destination)
        await _check_released(encoder)
        for pair in range(pairs):
            if _raw_first(pair):
                await run_raw(pair)
            rids = await _stage(encoder, f"mc-{size}-{pair}", n)
            start = time.perf_counter()
            for rid in rids:
                await encoder.send(rid, destination)
            wrapped.append(size * n / (time.perf_counter() - start))
            await _check_released(encoder)
            if not _raw_first(pair):
                await run_raw(pair)
    row = _row("mooncake", "sequential", size // MIB, n, raw, wrapped, distinct)
    # What one worker-thread hop per write costs by itself, and the Encoder against that.
    row["raw_hopped_gb_s"] = spread([x / 1e9 for x in hopped])
    row["hop_floor_efficiency"] = statistics.median(h / r for h, r in zip(hopped, raw, strict=True))
    row["efficiency_vs_hopped"] = statistics.median(
        enc / h for enc, h in zip(wrapped, hopped, strict=True)
    )
    # The least an async sender that waits for each write does, and the Encoder against it.
    row["submit_poll_gb_s"] = spread([x / 1e9 for x in polled])
    row["submit_poll_floor_efficiency"] = statistics.median(
        p / r for p, r in zip(polled, raw, strict=True)
    )
    row["efficiency_vs_submit_poll"] = statistics.median(
        enc / p for enc, p in zip(wrapped, polled, strict=True)
    )
    return row


async def _run_zmq(options: Options, pairs: int) -> dict[str, Any]:
    import numpy as np
    import zmq

    from encdisagg import ZmqDestination

    context = zmq.Context()
    ack = context.socket(zmq.PULL)
    ack.setsockopt(zmq.LINGER, 0)
    ack_port = ack.bind_to_random_port("tcp://127.0.0.1")
    process, peer, errors = start_peer("zmq", f"tcp://127.0.0.1:{ack_port}")
    url = peer["url"]
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 16)  # blocking sends: the loop waits for room
    push.connect(url)
    results: list[dict[str, Any]] = []
    sizes = _sizes(options)
    capacity = max(mib for mib, _ in sizes) * MIB
    source = np.random.default_rng(0).integers(0, 256, capacity, dtype=np.uint8)
    sender = ZmqRawSender(
        push, ack, source, url=url, context=context, row_bytes=BYTES_PER_TOKEN, hidden=HIDDEN
    )

    try:
        for mib, n in sizes:
            size = mib * MIB
            async with _encoder(size // BYTES_PER_TOKEN, "zmq") as encoder:
                sender.loop(size, 1, False)
                (rid,) = await _stage(encoder, f"warm-{mib}", 1)
                await encoder.send(rid, ZmqDestination(url))
                ack_wait(ack, 1)
                await _check_released(encoder)
                for mode in ("sequential", "pipelined"):
                    results.append(await _zmq_mode(encoder, url, ack, sender, mode, size, n, pairs))
                    print(_line(results[-1]), flush=True)
    finally:
        push.send(b"quit")
        stop_peer(process, errors)
        sender.close()
        push.close()
        ack.close()
        context.term()
    return {"rows": results}


async def _zmq_mode(
    encoder: Any,
    url: str,
    ack: Any,
    sender: ZmqRawSender,
    mode: str,
    size: int,
    n: int,
    pairs: int,
) -> dict[str, Any]:
    import anyio

    from encdisagg import ZmqDestination

    destination = ZmqDestination(url)
    pipelined = mode == "pipelined"
    raws: list[float] = []
    distinct: list[float] = []
    one_task: list[float] = []
    wrapped: list[float] = []

    async def run_raw(pair: int) -> None:
        raws.append(sender.loop(size, n, pipelined))
        distinct.append(sender.loop(size, n, pipelined, distinct_sources(size, n, pair)))
        one_task.append(await sender.one_task_per_message(size, n, pipelined))

    for pair in range(pairs):
        if _raw_first(pair):
            await run_raw(pair)
        rids = await _stage(encoder, f"zmq-{size}-{mode}-{pair}", n)
        start = time.perf_counter()
        if pipelined:
            async with anyio.create_task_group() as group:
                for rid in rids:
                    group.start_soon(encoder.send, rid, destination)
        else:
            for rid in rids:
                await encoder.send(rid, destination)
        ack_wait(ack, n)
        wrapped.append(size * n / (time.perf_counter() - start))
        await _check_released(encoder)
        if not _raw_first(pair):
            await run_raw(pair)
    row = _row("zmq", mode, size // MIB, n, raws, wrapped, distinct)
    # The least an async sender whose sends each return on the release does, against raw;
    # and the Encoder against it.
    row["one_task_per_message_gb_s"] = spread([x / 1e9 for x in one_task])
    row["one_task_floor_efficiency"] = statistics.median(
        t / r for t, r in zip(one_task, raws, strict=True)
    )
    row["efficiency_vs_one_task"] = statistics.median(
        enc / t for enc, t in zip(wrapped, one_task, strict=True)
    )
    return row


def _row(
    transport: str,
    mode: str,
    mib: int,
    n: int,
    raw: list[float],
    wrapped: list[float],
    distinct: list[float],
) -> dict[str, Any]:
    """One size on one transport: the pairs, and the median of their ratios."""
    ratios = [enc / r for enc, r in zip(wrapped, raw, strict=True)]
    distinct_ratios = [enc / d for enc, d in zip(wrapped, distinct, strict=True)]
    efficiency = statistics.median(ratios)
    row = {
        "transport": transport,
        "mode": mode,
        "size_mib": mib,
        "messages_per_run": n,
        "pairs": [
            {
                "raw_first": _raw_first(pair),
                "raw_gb_s": r / 1e9,
                "encoder_gb_s": enc / 1e9,
                "raw_distinct_gb_s": d / 1e9,
                "efficiency": enc / r,
            }
            for pair, (r, enc, d) in enumerate(zip(raw, wrapped, distinct, strict=True))
        ],
        "raw_gb_s": spread([x / 1e9 for x in raw]),
        "encoder_gb_s": spread([x / 1e9 for x in wrapped]),
        "raw_distinct_gb_s": spread([x / 1e9 for x in distinct]),
        "efficiency": efficiency,
        "efficiency_spread": spread(ratios),
        "efficiency_vs_distinct": statistics.median(distinct_ratios),
        "met": efficiency >= GOAL,
    }
    return row


def _line(row: dict[str, Any]) -> str:
    spread_ = row["efficiency_spread"]
    # The loops measured beside raw in this row (Mooncake: a thread hop, and submitted
    # writes polled on the loop; ZMQ: one task per message), against raw, and the Encoder
    # against each.
    beside = "".join(
        f"; {label} {row[floor]:.2f}x raw, Encoder {row[versus]:.2f}x that"
        for label, floor, versus in (
            ("raw through one thread hop", "hop_floor_efficiency", "efficiency_vs_hopped"),
            (
                "submitted and polled on the loop",
                "submit_poll_floor_efficiency",
                "efficiency_vs_submit_poll",
            ),
            ("one task per message", "one_task_floor_efficiency", "efficiency_vs_one_task"),
        )
        if floor in row
    )
    return (
        f"{row['transport']:>8} {row['mode']:>10} {row['size_mib']:>3} MiB: efficiency "
        f"{row['efficiency']:.2f}x (pairs {spread_['min']:.2f}..{spread_['max']:.2f}; "
        f"{row['efficiency_vs_distinct']:.2f}x vs distinct buffers); medians: raw "
        f"{row['raw_gb_s']['median']:.2f} GB/s, encoder {row['encoder_gb_s']['median']:.2f} GB/s"
        + beside
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
                f"{r['efficiency']:.2f}x",
                (x, 0),
                ha="center",
                va="bottom",
                fontsize=8,
                color="green" if r["met"] else "red",
                xytext=(0, 3),
                textcoords="offset points",
            )
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_ylabel("GB/s (median of pairs)")
        ax.set_title(
            f"Staged-embedding delivery vs raw transport; efficiency = median of pair "
            f"ratios (goal: >= {GOAL}x)",
            fontsize=10,
        )
        ax.legend(fontsize=8)

    write_png(options, "transfer", draw, size=(11, 4.5))


async def _main(options: Options) -> dict[str, Any]:
    pairs = options.repeats or options.pick(5, 3)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        notes.append(f"Mooncake not measured: {exc}")
    else:
        rows += (await _run_mooncake(options, pairs))["rows"]
    rows += (await _run_zmq(options, pairs))["rows"]
    return {"rows": rows, "pairs": pairs, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    import anyio

    options = parse_options(__doc__.splitlines()[0], args)
    data = anyio.run(_main, options)
    heads = []
    for row in data["rows"]:
        if row["transport"] == "zmq" and row["mode"] != "pipelined":
            continue
        heads.append(
            headline(
                f"transfer efficiency {row['transport']} {row['size_mib']} MiB",
                row["efficiency"],
                "x",
                goal=f">= {GOAL}x",
                met=row["met"],
                note=(
                    f"median of {len(row['pairs'])} Encoder/raw pairs; medians "
                    f"{row['encoder_gb_s']['median']:.2f} vs {row['raw_gb_s']['median']:.2f} GB/s"
                    + (f", {row['mode']}" if row["transport"] == "zmq" else "")
                    + f"; {row['efficiency_vs_distinct']:.2f}x raw over distinct buffers"
                ),
            )
        )
    data["headline"] = heads
    write_json(options, "transfer", data)
    _plot(options, data["rows"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
