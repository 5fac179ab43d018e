"""A prefill "host" for the multi-host fleet test, run as its own process group.

``python fleet_prefill.py --registry URL --host 127.0.0.5`` binds its receiver and every
connection it opens (to etcd and to encoders) to ``--host``, discovers the encoders through
the registry and fetches single-item requests through the fleet, ``--concurrency`` at a
time, until a line arrives on stdin. It prints one JSON line per request (``ok``, and
``exact``: the embedding equals the null model's, byte for byte), then a ``done`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import anyio
import anyio.to_thread
import httpx
import torch

from encdisagg import Modality
from encdisagg.models import NullVisionModel
from encdisagg.receiver import EmbeddingReceiver, EncoderClient, EncoderFleet, fetch_from_fleet

MODEL = NullVisionModel()


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(args: argparse.Namespace) -> None:
    def bound() -> httpx.AsyncHTTPTransport:
        # Every connection leaves from this host's own loopback address.
        return httpx.AsyncHTTPTransport(local_address=args.host)

    fleet = EncoderFleet(args.registry, model="null", transport=bound())
    receiver = EmbeddingReceiver(
        transport="zmq",
        hidden_size=MODEL.hidden_size,
        dtype=MODEL.dtype,
        bind=f"tcp://{args.host}:0",
    )
    stop = anyio.Event()
    counts = {"completed": 0, "failed": 0}
    async with (
        EncoderClient(registry=fleet, transport=bound(), encode_timeout_s=10.0) as client,
        receiver,
    ):
        with anyio.fail_after(30):
            await fleet.wait_for(1)
        say(event="ready", encoders=len(fleet.urls))

        async def watch_stdin() -> None:
            await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            stop.set()

        async def worker(index: int) -> None:
            n = 0
            while not stop.is_set():
                rid = f"w{index}-{n}"
                item = f"media-{index}-{n}"
                n += 1
                try:
                    async with fetch_from_fleet(
                        client, receiver, rid, {"image": [item]}, timeout_s=30.0
                    ) as got:
                        expected = torch.cat(
                            MODEL.forward([MODEL.preprocess([item], Modality.IMAGE)])
                        )
                        exact = torch.equal(got.parts[0].tensor, expected)
                except Exception as exc:
                    counts["failed"] += 1
                    say(rid=rid, ok=False, error=repr(exc)[:300])
                    continue
                counts["completed"] += 1
                say(rid=rid, ok=True, exact=exact)

        async with anyio.create_task_group() as group:
            group.start_soon(watch_stdin)
            async with anyio.create_task_group() as workers:
                for index in range(args.concurrency):
                    workers.start_soon(worker, index)
            group.cancel_scope.cancel()
    say(event="done", **counts)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--registry", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--backend", default="asyncio")
    options = parser.parse_args()
    anyio.run(partial(main, options), backend=options.backend)
