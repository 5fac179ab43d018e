"""Turns at reading body streams: oldest first, cancellation, the setting, real uploads.

The servers here run a small Quart (asyncio) or QuartTrio (Trio) app that answers each
body's length and digest, so what is checked is Hypercorn's read path with turns; asyncio
ignores the turns and must serve the same.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import anyio.abc
import httpx
import pytest
from quart import Quart, request

from encdisagg import BadRequestError
from encdisagg.server import serve
from encdisagg.server._asgi._read_turns import (
    DEFAULT_READ_TURNS,
    READ_TURNS_ENV,
    ReadTurns,
    read_turns_from_env,
)

pytestmark = pytest.mark.anyio

_MIB = 1024 * 1024


# -- ReadTurns ---------------------------------------------------------------------------


async def test_free_turns_are_taken_at_once_and_freed_when_given_back() -> None:
    turns = ReadTurns(2)
    await turns.take(turns.next_age())
    await turns.take(turns.next_age())
    assert turns.free == 0
    turns.give_back()
    turns.give_back()
    assert turns.free == 2


async def test_waiters_get_turns_oldest_first_whatever_their_arrival() -> None:
    turns = ReadTurns(1)
    ages = [turns.next_age() for _ in range(4)]
    await turns.take(ages[0])
    order: list[int] = []

    async def reader(age: int) -> None:
        await turns.take(age)
        order.append(age)
        turns.give_back()

    async with anyio.create_task_group() as group:
        for age in (ages[3], ages[1], ages[2]):  # youngest arrives first
            group.start_soon(reader, age)
        await anyio.wait_all_tasks_blocked()
        assert turns.waiting == 3
        turns.give_back()
    assert order == [ages[1], ages[2], ages[3]]
    assert turns.free == 1


async def test_a_cancelled_waiter_holds_no_turn() -> None:
    turns = ReadTurns(1)
    await turns.take(turns.next_age())
    with anyio.CancelScope() as scope:
        scope.cancel()
        await turns.take(turns.next_age())
    assert turns.waiting == 0
    turns.give_back()
    assert turns.free == 1


async def test_a_turn_handed_to_a_waiter_cancelled_meanwhile_goes_to_the_next() -> None:
    turns = ReadTurns(1)
    await turns.take(turns.next_age())
    older, younger = turns.next_age(), turns.next_age()
    got: list[int] = []

    async def reader(age: int, scope: anyio.CancelScope) -> None:
        with scope:
            await turns.take(age)
            got.append(age)
            turns.give_back()

    first, second = anyio.CancelScope(), anyio.CancelScope()
    async with anyio.create_task_group() as group:
        group.start_soon(reader, older, first)
        group.start_soon(reader, younger, second)
        await anyio.wait_all_tasks_blocked()
        turns.give_back()  # handed to the older waiter...
        first.cancel()  # ...which is cancelled before (Trio) or after (asyncio) it ran
    # Whoever had it passed it on: the younger reads, and no turn is lost.
    assert got in ([younger], [older, younger])
    assert turns.free == 1
    assert turns.waiting == 0


@pytest.mark.parametrize("turns", [0, -1, True, 1.5])
def test_turns_must_be_a_positive_integer(turns: object) -> None:
    with pytest.raises(BadRequestError, match="read turns"):
        ReadTurns(turns)  # type: ignore[arg-type]


def test_the_setting_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(READ_TURNS_ENV, raising=False)
    assert read_turns_from_env() == DEFAULT_READ_TURNS
    monkeypatch.setenv(READ_TURNS_ENV, "0")
    assert read_turns_from_env() == 0
    monkeypatch.setenv(READ_TURNS_ENV, " 2 ")
    assert read_turns_from_env() == 2
    for wrong in ("-1", "many"):
        monkeypatch.setenv(READ_TURNS_ENV, wrong)
        with pytest.raises(BadRequestError, match=READ_TURNS_ENV):
            read_turns_from_env()


# -- real servers --------------------------------------------------------------------------


def _digest_app(flavour: str) -> Quart:
    if flavour == "trio":
        from quart_trio import QuartTrio

        app: Quart = QuartTrio(__name__)
    else:
        app = Quart(__name__)

    @app.post("/digest")
    async def digest() -> dict[str, object]:
        data = await request.get_data(cache=False)
        assert isinstance(data, bytes)
        return {"length": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    @app.get("/ping")
    async def ping() -> str:
        return "pong"

    return app


@pytest.fixture
async def serving(anyio_backend_name: str) -> AsyncIterator[Callable[[int], Awaitable[str]]]:
    """``await start(turns)`` → the URL of a digest server reading streams in ``turns``
    turns (Trio; asyncio ignores them); every server stops when the test ends."""
    stop = anyio.Event()
    async with anyio.create_task_group() as group:

        async def run(turns: int, *, task_status: anyio.abc.TaskStatus[str]) -> None:
            await serve(
                _digest_app(anyio_backend_name),
                port=0,
                shutdown_trigger=stop.wait,
                on_serving=task_status.started,
                read_turns=turns,
            )

        async def start(turns: int) -> str:
            url: str = await group.start(run, turns)
            return url

        yield start
        stop.set()


def _body(seed: int, size: int) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (size // 32)


@pytest.mark.parametrize("turns", [1, 0])
async def test_concurrent_uploads_arrive_whole_beside_probes(
    serving: Callable[[int], Awaitable[str]],
    turns: int,
    anyio_backend_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken: list[int] = []
    take = ReadTurns.take

    async def counted_take(self: ReadTurns, age: int) -> None:
        taken.append(age)
        await take(self, age)

    monkeypatch.setattr(ReadTurns, "take", counted_take)
    url = await serving(turns)
    bodies = [_body(seed, 2 * _MIB) for seed in range(6)]
    answers: dict[int, dict[str, object]] = {}
    pings: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def upload(index: int) -> None:
            response = await client.post("/digest", content=bodies[index])
            answers[index] = response.json()

        async def probe() -> None:
            for _ in range(5):
                response = await client.get("/ping")
                pings.append(response.status_code)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for index in range(len(bodies)):
                    group.start_soon(upload, index)
                group.start_soon(probe)
    assert pings == [200] * 5
    # Only Trio's connections take turns, and only when the server has some.
    assert bool(taken) == (anyio_backend_name == "trio" and turns > 0)
    for index, body in enumerate(bodies):
        assert answers[index] == {
            "length": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
        }


async def test_a_client_silent_mid_body_holds_no_turn(
    serving: Callable[[int], Awaitable[str]],
) -> None:
    url = await serving(1)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    silent_body = _body(1, 2 * _MIB)
    head = (
        f"POST /digest HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(silent_body)}\r\n"
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    async with await anyio.connect_tcp(host, int(port)) as silent:
        # Enough that the server reads full chunks (a stream), then nothing more for now.
        half = len(silent_body) // 2
        await silent.send(head + silent_body[:half])
        other = _body(2, 2 * _MIB)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            with anyio.fail_after(60):
                response = await client.post("/digest", content=other)
        assert response.json()["sha256"] == hashlib.sha256(other).hexdigest()
        await silent.send(silent_body[half:])
        answer = b""
        with anyio.fail_after(60):
            while b"sha256" not in answer or not answer.rstrip().endswith(b"}"):
                answer += await silent.receive()
        assert hashlib.sha256(silent_body).hexdigest().encode() in answer
