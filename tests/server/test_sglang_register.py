"""``register_with``: the encoder announces itself to SGLang's encoder bootstrap.

The bootstrap is a real HTTP/1.1 server on a loopback port (a few lines over an AnyIO TCP
listener, so it runs on both backends), playing SGLang's ``EncoderBootstrapServer``: it
answers ``POST /register_encoder_url`` and ``DELETE /unregister_encoder_url``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from quart import Quart

from encdisagg import BadRequestError
from encdisagg.server import ServerSettings
from encdisagg.server._sglang._register import registered_with

from ._helpers import running

pytestmark = pytest.mark.anyio


@dataclass
class Bootstrap:
    """What the fake bootstrap saw; ``refuse`` first registrations get a 503."""

    url: str = ""
    refuse: int = 0
    calls: list[tuple[str, str, object]] = field(default_factory=list)
    changed: anyio.Event = field(default_factory=anyio.Event)

    async def serve(self, stream: SocketStream) -> None:
        async with stream:
            reader = BufferedByteReceiveStream(stream)
            head = (await reader.receive_until(b"\r\n\r\n", 65536)).decode("latin-1")
            method, path, _ = head.split("\r\n")[0].split(" ")
            headers = dict(
                line.lower().split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line
            )
            length = int(headers.get("content-length", "0"))
            body = json.loads(await reader.receive_exactly(length)) if length else None
            self.calls.append((method, path, body))
            status = "200 OK"
            if method == "POST" and self.refuse > 0:
                self.refuse -= 1
                status = "503 Service Unavailable"
            await stream.send(
                f"HTTP/1.1 {status}\r\ncontent-length: 2\r\nconnection: close\r\n\r\nOK".encode()
            )
            self.changed.set()
            self.changed = anyio.Event()

    async def wait_for(self, count: int) -> None:
        with anyio.fail_after(30):
            while len(self.calls) < count:
                await self.changed.wait()


@asynccontextmanager
async def bootstrap(refuse: int = 0) -> AsyncIterator[Bootstrap]:
    state = Bootstrap(refuse=refuse)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    state.url = f"http://127.0.0.1:{port}"
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, state.serve)
        yield state
        group.cancel_scope.cancel()


async def test_retries_until_accepted_then_unregisters_on_exit() -> None:
    async with bootstrap(refuse=2) as server:
        async with registered_with(server.url, "http://10.0.0.7:8000", first_pause_s=0.01) as state:
            with anyio.fail_after(30):
                await state.registered.wait()
            assert state.attempts == 3
        assert server.calls == [
            ("POST", "/register_encoder_url", {"url": "http://10.0.0.7:8000"}),
            ("POST", "/register_encoder_url", {"url": "http://10.0.0.7:8000"}),
            ("POST", "/register_encoder_url", {"url": "http://10.0.0.7:8000"}),
            ("DELETE", "/unregister_encoder_url", {"url": "http://10.0.0.7:8000"}),
        ]


async def test_gives_up_after_its_attempts_and_does_not_unregister() -> None:
    async with bootstrap(refuse=100) as server:
        async with registered_with(
            server.url, "http://e:1", attempts=2, first_pause_s=0.01
        ) as state:
            await server.wait_for(2)
            await anyio.wait_all_tasks_blocked()
        assert not state.registered.is_set()
        assert "HTTP 503" in state.last_error
        assert [method for method, _, _ in server.calls] == ["POST", "POST"]


async def test_an_unreachable_bootstrap_is_retried_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    await listener.aclose()  # nobody listens there now
    async with registered_with(
        f"http://127.0.0.1:{port}", "http://e:1", attempts=2, first_pause_s=0.01
    ) as state:
        with anyio.fail_after(30):
            while state.attempts < 2 or "gave up" not in caplog.text:
                await anyio.wait_all_tasks_blocked()
                await anyio.lowlevel.checkpoint()
    assert not state.registered.is_set()
    assert "ConnectError" in state.last_error


async def test_the_server_registers_at_startup_and_unregisters_at_shutdown(
    make_app: Callable[..., Quart],
) -> None:
    async with bootstrap() as server:
        app = make_app(
            wire="sglang", register_with=server.url, advertise_url="http://encoder-3:9000"
        )
        async with running(app):
            await server.wait_for(1)
            assert server.calls == [
                ("POST", "/register_encoder_url", {"url": "http://encoder-3:9000"})
            ]
        assert server.calls[-1] == (
            "DELETE",
            "/unregister_encoder_url",
            {"url": "http://encoder-3:9000"},
        )


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"wire": "grpc"}, "wire must be"),
        ({"register_with": "http://b:1"}, "register_with needs wire='sglang'"),
        ({"wire": "sglang", "register_with": "b:1"}, "register_with must be an http"),
        ({"wire": "sglang", "advertise_url": "tcp://x:1"}, "advertise_url must be an http"),
    ],
)
def test_settings_are_checked(values: dict[str, str], match: str) -> None:
    with pytest.raises(BadRequestError, match=match):
        ServerSettings(**values)
