"""A scripted stand-in for a data-parallel worker (unit tests of the front only).

Speaks the worker protocol with plain blocking ZMQ and msgpack, imports nothing from
encdisagg (so it starts in a blink and checks the protocol independently), and logs every
message it receives as a JSON line to ``--log DIR/worker-RANK.jsonl``.

Scripts:
- ``echo``: answers every call at once.
- ``silent``: never answers ``encode``; answers everything else.
- ``garbage``: sends malformed replies before each real one.
- ``die-on-encode``: exits with code 3 when an encode for ``req_id == "die"`` arrives.
- ``stubborn``: ignores ``stop`` and SIGTERM.
- ``mute``: never reports ready (but obeys ``stop``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import msgpack
import zmq


def result(req_id: str, rank: int) -> dict[str, Any]:
    return {
        "req_id": req_id,
        "num_tokens": rank + 1,
        "hidden_size": 8,
        "dtype": "float16",
        "nbytes": (rank + 1) * 16,
        "token_counts": [rank + 1],
        "grid": [[1, 2, 2 * (rank + 1)]],
    }


def answer(op: str, args: dict[str, Any], rank: int) -> Any:
    if op in ("encode", "metadata"):
        return result(args["req_id"], rank)
    if op == "health":
        return {"ok": True, "probed": False, "message": ""}
    if op == "stats":
        return {"requests": [], "histograms": {}, "gauges": {"live_requests": rank}, "cache": {}}
    return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--script", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args, _ = parser.parse_known_args()
    rank = args.rank
    log = Path(args.log) / f"worker-{rank}.jsonl"
    if args.script == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    context = zmq.Context()
    work = context.socket(zmq.PULL)
    work.connect(args.work)
    control = context.socket(zmq.PULL)
    control.connect(args.control)
    results = context.socket(zmq.PUSH)
    results.connect(args.results)

    def send(message: Any) -> None:
        results.send(message if isinstance(message, bytes) else msgpack.packb(message))

    def record(channel: str, message: Any) -> None:
        with log.open("a") as file:
            file.write(json.dumps({"channel": channel, "message": message}) + "\n")

    if args.script != "mute":
        send({"kind": "ready", "rank": rank, "pid": os.getpid()})
    poller = zmq.Poller()
    poller.register(work, zmq.POLLIN)
    poller.register(control, zmq.POLLIN)
    while True:
        events = dict(poller.poll(200))
        if os.getppid() != args.parent_pid:
            return 0
        if control in events:
            message = msgpack.unpackb(control.recv())
            record("control", message)
            if message.get("op") == "stop" and args.script != "stubborn":
                return 0
        if work in events:
            message = msgpack.unpackb(work.recv())
            record("work", message)
            op, call_id, call_args = message["op"], message["id"], message["args"]
            if args.script == "die-on-encode" and op == "encode" and call_args["req_id"] == "die":
                os._exit(3)
            if args.script == "silent" and op == "encode":
                continue
            if args.script == "garbage":
                for junk in (
                    b"\xc1",
                    msgpack.packb([1, 2]),
                    {"kind": "result", "rank": rank},
                    {"kind": "result", "rank": rank, "id": call_id, "value": 1, "error": None},
                    {"kind": "result", "rank": 99, "id": call_id, "value": None},
                    {"kind": "ready", "rank": rank, "pid": -1},
                    {"kind": "result", "rank": rank, "id": call_id, "error": {"type": "os"}},
                ):
                    send(junk)
            send(
                {
                    "kind": "result",
                    "rank": rank,
                    "id": call_id,
                    "value": answer(op, call_args, rank),
                }
            )


if __name__ == "__main__":
    sys.exit(main())
