"""A soak against the real server: many requests, random client cancellations, injected
engine failures.

Each request follows a random script (encode and send over Mooncake-style writes or ZMQ,
push mode, release, a malformed body, an unknown id); one client in eight gives up after a
random 1-20 ms and disconnects, mid-encode or mid-send. The engine fails registrations and
writes at random. A *violation* is a 500, an answer the script does not allow, or a call
past its bound. At the end: no violations, the Encoder and the recording engine hold nothing,
and the resident memory did not grow.

300 requests per backend in CI; 20,000 under ``ENCDISAGG_SOAK=1`` (with a report).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import anyio
import httpx
import pytest

from encdisagg import Encoder
from encdisagg.models import NullVisionModel
from encdisagg.transfer import ZmqReceiver

from ..encoder.fakes import RecordingEngine
from ._support import (
    SOAK,
    fast_config,
    rss_mib,
    running_server,
    sized,
    wait_idle,
    write_soak_report,
)

pytestmark = pytest.mark.anyio

REQUESTS = sized(300, 20_000)
CONCURRENCY = 16
#: What each script may be answered with (besides being cancelled by its own client).
ALLOWED = {
    "encode": {200},
    "send": {200, 502},  # 502: an injected write or registration failure
    "push": {200},
    "metadata": {200},
    "release": {200},
    "malformed": {400},
    "unknown": {404},
}


async def test_soak_has_no_violations_and_no_leaks(anyio_backend_name: str) -> None:
    rng = random.Random(20261130)
    engine = RecordingEngine(
        rng=random.Random(3), register_failure_rate=0.05, write_failure_rate=0.05
    )
    # 2 KiB embeddings; a request whose client left between encode and send expires after
    # send_timeout_s.
    config = fast_config(transfer="loopback", send_timeout_s=2.0, request_timeout_s=5.0)
    encoder = Encoder(config, model=NullVisionModel(), engine=engine)
    remote = [engine.add_remote_buffer(16 * 64 * 2) for _ in range(64)]
    answers: Counter[str] = Counter()
    violations: list[str] = []
    cancelled = 0
    rss: dict[str, float] = {}
    started = time.perf_counter()

    async with (
        running_server(encoder) as url,
        ZmqReceiver(max_queued_messages=100_000) as receiver,
        httpx.AsyncClient(
            base_url=url,
            timeout=20.0,
            limits=httpx.Limits(max_connections=CONCURRENCY * 2),
        ) as client,
        anyio.create_task_group() as background,
    ):

        async def drain() -> None:
            while True:
                await receiver.receive()

        background.start_soon(drain)
        rss["start"] = rss_mib()

        class ClientLeft(Exception):
            """The client gave up on a call (its read timeout ran out) and disconnected."""

        async def call(
            step: str,
            route: str,
            body: dict[str, Any],
            patience: float,
            encode_started: float | None = None,
        ) -> int:
            timeout = httpx.Timeout(20.0, read=patience)
            with anyio.move_on_after(15) as bound:  # every bound inside is far shorter
                try:
                    response = await client.post(route, json=body, timeout=timeout)
                except httpx.TimeoutException:
                    if patience >= 20.0:
                        violations.append(f"{route} {body.get('req_id')}: client timeout")
                    raise ClientLeft from None
            if bound.cancelled_caught:
                violations.append(f"{route} {body.get('req_id')}: no answer within its bound")
                return -1
            status = response.status_code
            answers[f"{step} {status}"] += 1
            if (
                status == 409
                and encode_started is not None
                and time.perf_counter() - encode_started >= config.send_timeout_s
            ):
                # Staged for longer than send_timeout_s (a loaded machine answers slowly):
                # the request expired on its own deadline, as it should.
                return status
            if status not in ALLOWED[step]:
                violations.append(f"{route} {body}: {status} {response.text[:200]}")
            return status

        def destination(rid: str, index: int) -> dict[str, Any]:
            if index % 2:
                return {"req_id": rid, "receive_url": receiver.url}
            buffer = remote[index % len(remote)]
            return {
                "req_id": rid,
                "session_id": engine.session_id,
                "buffer_address": buffer.data_ptr(),
                "prefill_host": "prefill",
                "embedding_port": 1 + index % 1000,
            }

        async def script(index: int, patience: float) -> None:
            rid = f"soak-{index}"
            roll = rng.random()

            encode_started: float | None = None

            async def step(name: str, route: str, body: dict[str, Any]) -> int:
                return await call(name, route, body, patience, encode_started)

            if roll < 0.05:
                await step("malformed", "/encode", {"req_id": rid, "mm_items": "not a list"})
                return
            if roll < 0.10:
                body = {"req_id": f"never-{index}", "receive_url": receiver.url}
                await step("unknown", "/send", body)
                return
            started = time.perf_counter()
            if await step("encode", "/encode", {"req_id": rid, "mm_items": [rid]}) != 200:
                return
            encode_started = started
            if roll < 0.20:
                await step("release", "/release", {"req_id": rid})
            elif roll < 0.30:
                # Push mode, the way a prefill scheduler drives it: metadata, then the URL.
                await step(
                    "metadata", "/scheduler_receive_meta_data", {"req_id": rid, "part_idx": 0}
                )
                body = {"req_id": rid, "receive_count": 1, "receive_url": receiver.url}
                await step("push", "/scheduler_receive_url", body)
            else:
                await step("send", "/send", destination(rid, index))

        counter = iter(range(REQUESTS))

        async def worker() -> None:
            nonlocal cancelled
            for index in counter:
                # One client in eight gives up after a random moment, during its encode or
                # its send (or between them), and disconnects.
                leaves = rng.random() < 0.125
                try:
                    await script(index, rng.uniform(0.001, 0.02) if leaves else 20.0)
                except ClientLeft:
                    cancelled += 1
                if index == REQUESTS // 4:
                    rss["warm"] = rss_mib()
                if index % 1000 == 0:
                    engine.log.clear()  # the fake's own history; not the encoder's memory

        async with anyio.create_task_group() as group:
            for _ in range(CONCURRENCY):
                group.start_soon(worker)

        # Requests left staged by clients that went away expire on their own deadline.
        await wait_idle(encoder, bound_s=config.send_timeout_s + 10.0)
        response = await client.get("/health")
        assert response.status_code == 200, response.text
        rss["end"] = rss_mib()
        background.cancel_scope.cancel()

    stats = encoder.stats()
    elapsed = time.perf_counter() - started
    summary = {
        "backend": anyio_backend_name,
        "requests": REQUESTS,
        "client_cancellations": cancelled,
        "answers": dict(sorted(answers.items())),
        "violations": violations[:20],
        "violation_count": len(violations),
        "engine_violations": list(engine.violations),
        "leaked_regions": len(engine.regions),
        "stats_after": {
            "live_requests": stats.live_requests,
            "staged_bytes": stats.staged_bytes,
            "registered_regions": stats.registered_regions,
            "inflight_transfers": stats.inflight_transfers,
        },
        "rss_mib": rss,
        "seconds": elapsed,
    }
    print(f"soak ({anyio_backend_name}): {summary}")
    growth = rss["end"] - rss.get("warm", rss["start"])
    if SOAK:
        write_soak_report(
            f"soak-{anyio_backend_name}",
            {
                **summary,
                "headline": [
                    {
                        "figure": f"soak {REQUESTS:,} requests ({anyio_backend_name})",
                        "value": len(violations) + len(engine.violations) + len(engine.regions),
                        "unit": "violations+leaks",
                        "goal": "0",
                        "met": not violations and not engine.violations and not engine.regions,
                        "note": (
                            f"{cancelled} client cancellations, "
                            f"{answers['send 502']} injected send failures; RSS "
                            f"{rss['start']:.0f} -> {rss['end']:.0f} MiB; {elapsed:.0f} s"
                        ),
                    }
                ],
            },
        )
    assert violations == []
    assert engine.violations == []
    assert engine.regions == {}
    assert stats.live_requests == 0
    assert stats.staged_bytes == 0
    assert stats.registered_regions == 0
    assert answers["send 200"] > 0
    assert answers["send 502"] > 0 or not SOAK
    assert cancelled > 0
    if SOAK:
        assert growth < 64, f"resident memory grew by {growth:.0f} MiB after warm-up: {rss}"
