"""The data-parallel front against scripted worker processes (real processes, real ZMQ IPC).

The workers here are ``scripted_worker.py``: a protocol stand-in, so each behaviour
(silence, garbage, death, stubbornness) is exact and every test is fast.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from encdisagg import (
    NotFoundError,
    RequestTimeoutError,
    ServiceUnavailableError,
    ZmqDestination,
)
from encdisagg.server import (
    DataParallelBackend,
    EncodeBody,
    MetadataBody,
    ReceiveUrlBody,
    SendBody,
    ServerSettings,
)

from ._helpers import fast_config

pytestmark = pytest.mark.anyio

SCRIPT = str(Path(__file__).with_name("scripted_worker.py"))


@asynccontextmanager
async def front(
    tmp_path: Path, script: str, *, workers: int = 1, stop_s: float = 2.0, **config: Any
) -> AsyncIterator[DataParallelBackend]:
    backend = DataParallelBackend(
        fast_config(model="null", **config),
        workers=workers,
        settings=ServerSettings(
            dp=workers,
            worker_start_timeout_s=20,
            worker_stop_timeout_s=stop_s,
            health_timeout_s=2,
            # A dead worker stays dead here: these tests show what it leaves behind.
            worker_restart_limit=0,
        ),
        worker_command=[sys.executable, SCRIPT, "--script", script, "--log", str(tmp_path)],
    )
    async with backend:
        yield backend


def logged(tmp_path: Path, rank: int) -> list[dict[str, Any]]:
    path = tmp_path / f"worker-{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


async def wait_logged(
    tmp_path: Path, rank: int, predicate: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    with anyio.fail_after(10):
        while True:
            for entry in logged(tmp_path, rank):
                if predicate(entry):
                    return entry
            await anyio.sleep(0.02)


def encode(req_id: str) -> EncodeBody:
    return EncodeBody.from_json({"req_id": req_id, "mm_items": ["x"]})


async def test_encodes_spread_and_later_calls_follow_the_request(tmp_path: Path) -> None:
    async with front(tmp_path, "echo", workers=2) as backend:
        results = {}

        async def one(req_id: str) -> None:
            results[req_id] = await backend.encode(encode(req_id))

        async with anyio.create_task_group() as group:
            for index in range(6):
                group.start_soon(one, f"r{index}")
        ranks = {req_id: backend.rank_of(req_id) for req_id in results}
        assert sorted(ranks.values()) == [0, 0, 0, 1, 1, 1]
        for req_id, result in results.items():
            assert result.num_tokens == ranks[req_id] + 1  # answered by that worker

        target = ranks["r4"]
        await backend.send(SendBody("r4", ZmqDestination("tcp://127.0.0.1:9")))
        await backend.metadata(MetadataBody("r4", 0))
        await backend.register(ReceiveUrlBody("r4", 1, ("tcp://127.0.0.1:9",)))
        await backend.release("r4")
        ops = [e["message"]["op"] for e in logged(tmp_path, target) if e["channel"] == "work"]
        assert ops[-4:] == ["send", "metadata", "register", "release"]
        # An encode of an id a worker holds goes to that worker (which answers 409 if live).
        await backend.encode(encode("r4"))
        assert backend.rank_of("r4") == target

        with pytest.raises(NotFoundError):
            await backend.send(SendBody("nobody", ZmqDestination("tcp://127.0.0.1:9")))
        await backend.release("nobody")  # unknown: a no-op, like the Encoder's

        snapshot = await backend.snapshot()
        assert snapshot.encoder.gauges["live_requests"] == 0 + 1  # ranks 0 and 1 report 0, 1
        assert [w.alive for w in snapshot.workers] == [True, True]
        assert (await backend.health()).ok


async def test_metadata_waits_for_the_encode_to_be_routed(tmp_path: Path) -> None:
    async with front(tmp_path, "echo", workers=2) as backend:
        async with anyio.create_task_group() as group:
            answers = []

            async def wait() -> None:
                answers.append(await backend.metadata(MetadataBody("later", 0)))

            group.start_soon(wait)
            await anyio.sleep(0.1)
            await backend.encode(encode("later"))
        assert answers[0].req_id == "later"


async def test_metadata_for_an_id_never_routed_times_out(tmp_path: Path) -> None:
    async with front(tmp_path, "echo", request_timeout_s=0.2) as backend:
        with pytest.raises(RequestTimeoutError):
            await backend.metadata(MetadataBody("never", 0))


async def test_malformed_replies_are_dropped_and_the_listener_goes_on(tmp_path: Path) -> None:
    async with front(tmp_path, "garbage") as backend:
        for index in range(3):
            result = await backend.encode(encode(f"g{index}"))
            assert result.req_id == f"g{index}"
        assert backend.malformed_messages >= 3 * 6
        snapshot = await backend.snapshot()
        assert snapshot.malformed_messages == backend.malformed_messages


async def test_dispatch_timeout_tells_the_worker_to_cancel_and_release(tmp_path: Path) -> None:
    async with front(tmp_path, "silent", request_timeout_s=0.3) as backend:
        with pytest.raises(RequestTimeoutError) as caught:
            await backend.encode(encode("slow"))
        assert caught.value.status == 504
        assert caught.value.req_id == "slow"
        call = await wait_logged(
            tmp_path, 0, lambda e: e["channel"] == "work" and e["message"]["op"] == "encode"
        )
        call_id = call["message"]["id"]
        await wait_logged(tmp_path, 0, lambda e: e["message"] == {"op": "cancel", "id": call_id})
        await wait_logged(
            tmp_path, 0, lambda e: e["message"] == {"op": "release", "req_id": "slow"}
        )
        assert backend.workers[0].pending == 0


async def test_cancelled_dispatch_tells_the_worker_to_cancel_and_release(tmp_path: Path) -> None:
    async with front(tmp_path, "silent") as backend:
        with anyio.move_on_after(0.3) as scope:
            await backend.encode(encode("left"))
        assert scope.cancelled_caught
        await wait_logged(
            tmp_path, 0, lambda e: e["message"] == {"op": "release", "req_id": "left"}
        )
        assert backend.workers[0].pending == 0
        # The worker still answers the next call.
        await backend.send(SendBody("left", ZmqDestination("tcp://127.0.0.1:9")))


async def test_a_dead_worker_fails_its_requests_with_503(tmp_path: Path) -> None:
    async with front(tmp_path, "die-on-encode", workers=2) as backend:
        await backend.encode(encode("survivor"))
        survivor_rank = backend.rank_of("survivor")
        assert survivor_rank is not None
        # The next encode goes to the other, idle-tied worker... which dies on it.
        with pytest.raises(ServiceUnavailableError) as caught:
            await backend.encode(encode("die"))
        assert caught.value.status == 503
        assert "exit code 3" in caught.value.message
        dead = backend.rank_of("die")
        assert dead is not None
        assert dead != survivor_rank
        assert [w.alive for w in backend.workers] == [dead != 0, dead != 1]

        report = await backend.health()
        assert not report.ok
        assert "down" in report.message
        with pytest.raises(ServiceUnavailableError):
            await backend.metadata(MetadataBody("die", 0))
        with pytest.raises(ServiceUnavailableError):
            await backend.send(SendBody("die", ZmqDestination("tcp://127.0.0.1:9")))
        # The live worker keeps serving, new requests included.
        await backend.metadata(MetadataBody("survivor", 0))
        for index in range(3):
            await backend.encode(encode(f"after{index}"))
            assert backend.rank_of(f"after{index}") == survivor_rank


async def test_a_worker_that_fails_to_start_fails_the_service(tmp_path: Path) -> None:
    backend = DataParallelBackend(
        fast_config(model="null"),
        workers=2,
        settings=ServerSettings(dp=2, worker_start_timeout_s=20),
        worker_command=[sys.executable, "-c", "import sys; sys.exit(5)"],
    )
    with pytest.raises(ServiceUnavailableError, match="exited with code 5"):
        async with backend:
            pass


async def test_a_stubborn_worker_is_killed(tmp_path: Path) -> None:
    started = anyio.current_time()
    async with front(tmp_path, "stubborn", stop_s=0.5) as backend:
        await backend.encode(encode("s"))
        assert backend.pid_of(0) is not None
    # stop message (0.5 s), SIGTERM (0.5 s), then SIGKILL.
    assert anyio.current_time() - started < 10
    assert backend.workers[0].alive is False
    assert any(e["message"] == {"op": "stop"} for e in logged(tmp_path, 0))


async def test_a_cancelled_start_still_stops_the_workers(tmp_path: Path) -> None:
    backend = DataParallelBackend(
        fast_config(model="null"),
        workers=2,
        settings=ServerSettings(dp=2, worker_start_timeout_s=60, worker_stop_timeout_s=5),
        worker_command=[sys.executable, SCRIPT, "--script", "mute", "--log", str(tmp_path)],
    )
    with anyio.move_on_after(1.0) as scope:
        async with backend:
            pytest.fail("mute workers never report ready")
    assert scope.cancelled_caught
    for rank in (0, 1):
        pid = backend.pid_of(rank)
        assert pid is not None
        with pytest.raises(ProcessLookupError):  # exited and reaped
            os.kill(pid, 0)
        assert any(e["message"] == {"op": "stop"} for e in logged(tmp_path, rank))


async def test_workers_not_ready_in_time_fail_the_start(tmp_path: Path) -> None:
    backend = DataParallelBackend(
        fast_config(model="null"),
        workers=1,
        settings=ServerSettings(dp=1, worker_start_timeout_s=0.5, worker_stop_timeout_s=5),
        worker_command=[sys.executable, SCRIPT, "--script", "mute", "--log", str(tmp_path)],
    )
    with pytest.raises(ServiceUnavailableError, match="not ready within"):
        async with backend:
            pass
