"""Hostile and careless HTTP clients against real ``encdisagg serve`` processes.

Three servers, each started once for the module on loopback: the asyncio and the Trio
worker class (tiny model), and a ``--dp 2`` front (null model). Every one runs with an API
key, an allow-list of peers and a limit of 256 open descriptors, and each test asserts the
safe outcome: a 4xx naming the field (never a 5xx), 401 without the key, 403 for a peer
outside the list, descriptors released by connections their clients closed.

The tests drive the servers with blocking clients: what is under test is the server's
event loop (its worker class), not the client's.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from encdisagg.receiver import EncoderCallError, EncoderClient

from ._helpers import png_data_url

KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
DESCRIPTORS = 256
HERE = Path(__file__).parent
IMAGE = png_data_url(56, 56)


class Server:
    def __init__(self, name: str, url: str, process: subprocess.Popen[bytes]) -> None:
        self.name = name
        self.url = url
        self.process = process
        self.tiny = not name.endswith("dp2")

    def post(self, route: str, body: Any, **kwargs: Any) -> httpx.Response:
        headers = {**AUTH, **kwargs.pop("headers", {})}
        if isinstance(body, bytes):
            headers.setdefault("Content-Type", "application/json")
            return httpx.post(self.url + route, content=body, headers=headers, timeout=60)
        return httpx.post(self.url + route, json=body, headers=headers, timeout=60)


def _start(name: str, worker_class: str, dp: int, folder: Path) -> Server:
    config = folder / f"{name}.toml"
    config.write_text(
        "[server]\n"
        'allowed_peers = ["127.0.0.1", "10.0.0.0/8", "prefill-0.internal"]\n'
        "max_body_mb = 4\n"
        "[encoder]\n"
        "request_timeout_s = 10.0\nsend_timeout_s = 10.0\nzmq_send_timeout_s = 5.0\n"
        "shutdown_grace_s = 5.0\ncleanup_timeout_s = 5.0\n"
    )
    command = [
        sys.executable, str(HERE / "limited_serve.py"), str(DESCRIPTORS), "serve",
        "--config", str(config), "--port", "0", "--worker-class", worker_class,
        "--model", "tiny" if dp == 1 else "null", "--dp", str(dp), "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "ENCDISAGG_API_KEY": KEY}
    with (folder / f"{name}.log").open("wb") as stderr:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env
        )
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        ready = selector.select(timeout=180)
    line = process.stdout.readline().decode() if ready else ""
    prefix = "encdisagg serving on "
    if not line.startswith(prefix):
        process.kill()
        process.wait()
        process.stdout.close()
        log = (folder / f"{name}.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"{name} did not start: {line!r}\n{log}")
    return Server(name, line[len(prefix) :].strip(), process)


def _stop(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    finally:
        assert server.process.stdout is not None
        server.process.stdout.close()


@pytest.fixture(
    scope="module",
    params=[("asyncio", "asyncio", 1), ("trio", "trio", 1), ("asyncio-dp2", "asyncio", 2)],
    ids=lambda param: param[0],
)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    name, worker_class, dp = request.param
    with tempfile.TemporaryDirectory() as folder:
        started = _start(name, worker_class, dp, Path(folder))
        try:
            yield started
        finally:
            _stop(started)


def assert_refused(response: httpx.Response, status: int, needle: str) -> None:
    assert response.status_code == status, response.text
    answer = response.json()
    assert set(answer) == {"status", "message", "req_id"}
    assert answer["status"] == "error"
    assert needle in answer["message"], answer["message"]
    assert " at 0x" not in answer["message"]


ROUTES = ("/encode", "/send", "/scheduler_receive_url", "/scheduler_receive_meta_data", "/release")


# --- access control --------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer"]
)
def test_every_route_but_health_and_metrics_needs_the_key(
    server: Server, route: str, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    response = httpx.post(server.url + route, json={"req_id": "a"}, headers=headers, timeout=30)
    assert_refused(response, 401, "API key")
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_a_body_without_the_key_is_never_read(server: Server) -> None:
    """The 401 comes before the body: a client announcing 3 MB and sending none is
    answered at once (were the body awaited, this would time out)."""
    url = httpx.URL(server.url)
    assert url.port is not None
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(
            b"POST /encode HTTP/1.1\r\nHost: encdisagg\r\nContent-Type: application/json\r\n"
            b"Content-Length: 3000000\r\n\r\n"
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            assert chunk, "closed without an answer"
            head += chunk
    assert head.startswith(b"HTTP/1.1 401 ")


def test_health_and_metrics_need_no_key(server: Server) -> None:
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    metrics = httpx.get(server.url + "/metrics", timeout=30)
    assert metrics.status_code == 200
    assert 'encdisagg_http_requests_total{code="401"' in metrics.text


@pytest.mark.parametrize(
    ("session_id", "status"),
    [
        ("192.168.1.1:5000", 403),
        ("evil.example:5000", 403),
        ("[::1]:5000", 403),
        ("10.1.2.3", 403),
        ("10.1.2.3:5000", 404),
        ("prefill-0.internal:5000", 404),
    ],
)
def test_mooncake_send_to_a_peer_outside_the_allow_list_is_403(
    server: Server, session_id: str, status: int
) -> None:
    body = {
        "req_id": "nobody",
        "session_id": session_id,
        "buffer_address": 4096,
        "prefill_host": "10.1.2.3",
        "embedding_port": 5000,
    }
    response = server.post("/send", body)
    # Allowed peers get as far as the request table (which knows no such id).
    assert_refused(response, status, "session_id" if status == 403 else "nobody")


def test_zmq_destinations_outside_the_allow_list_are_403(server: Server) -> None:
    response = server.post("/send", {"req_id": "nobody", "receive_url": "tcp://192.0.2.1:9"})
    assert_refused(response, 403, "receive_url")
    response = server.post(
        "/scheduler_receive_url",
        {"req_id": "n", "receive_count": 2, "receive_url": ["127.0.0.1:9", "192.0.2.1:9"]},
    )
    assert_refused(response, 403, "receive_url[1]")


@pytest.mark.anyio
async def test_encoder_client_carries_the_key(server: Server) -> None:
    async with EncoderClient([server.url], api_key=KEY) as client:
        plan = client.plan(f"client-{server.name}", {"image": [IMAGE]})
        (metadata,) = await client.encode(plan)
        assert metadata.embedding_len > 0
        assert await client.release(plan.parts) == {plan.parts[0].req_id}
    async with EncoderClient([server.url]) as client:
        plan = client.plan(f"keyless-{server.name}", {"image": [IMAGE]})
        with pytest.raises(EncoderCallError) as caught:
            await client.encode(plan)
    assert caught.value.status == 401


# --- strict bodies ---------------------------------------------------------------------------

DEEP_LIST = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"a":' * 100_000 + b"1" + b"}" * 100_000


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body", [DEEP_LIST, DEEP_OBJECT], ids=["list", "object"])
def test_deep_nesting_is_400_on_every_route(server: Server, route: str, body: bytes) -> None:
    assert_refused(server.post(route, body), 400, "nested more than")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_a_body_not_declared_json_is_415(
    server: Server, route: str, content_type: str | None
) -> None:
    headers = dict(AUTH)
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = json.dumps({"req_id": "a", "mm_items": [IMAGE]}).encode()
    response = httpx.post(server.url + route, content=body, headers=headers, timeout=30)
    assert_refused(response, 415, "application/json")


HUGE = 2**64
SEND_MOONCAKE = '"session_id": "10.0.0.1:1", "prefill_host": "h", "embedding_port": 1'
CASES: list[tuple[str, bytes, str]] = [
    ("/encode", b'{"req_id": "a", "mm_items": ["x"], "num_parts": %d}' % HUGE, "num_parts"),
    ("/encode", b'{"req_id": "a", "mm_items": ["x"], "part_idx": -%d}' % HUGE, "part_idx"),
    ("/send", b'{"req_id": "a", "buffer_address": %d, %s}' % (HUGE, SEND_MOONCAKE.encode()),
     "buffer_address"),
    ("/send", b'{"req_id": "a", "receive_url": "tcp://h:1", "receive_count": %d}' % HUGE,
     "receive_count"),
    ("/scheduler_receive_meta_data", b'{"req_id": "a", "part_idx": %d}' % (2**70), "part_idx"),
    ("/encode", b'{"req_id": "a", "mm_items": ["x"], "num_parts": 1e400}', "num_parts"),
    ("/encode", b'{"req_id": "\\ud800", "mm_items": ["x"]}', "req_id"),
    ("/send", b'{"req_id": "a\\udfff", "receive_url": "tcp://h:1"}', "req_id"),
    ("/release", b'{"req_id": "\\ud83d"}', "req_id"),
    ("/encode", b'{"req_id": "a", "mm_items": ["\\ud800"]}', "mm_items[0]"),
    ("/encode", b'{"req_id": "a", "mm_items": [{"url": "x", "\\udc00": 1}]}', "mm_items[0]"),
    ("/encode", b'{"req_id": "a", "req_id": "b", "mm_items": ["x"]}', "duplicate field 'req_id'"),
    ("/release", b'{"req_id": "a", "req_id": "a"}', "duplicate field 'req_id'"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "needle"), CASES)
def test_values_no_later_stage_can_carry_are_400_naming_the_field(
    server: Server, route: str, body: bytes, needle: str
) -> None:
    assert_refused(server.post(route, body), 400, needle)


@pytest.mark.parametrize(
    "url",
    ["foo://h:1", "tcp://", "tcp://*:5555", "ipc:///tmp/x", "tcp://h:0", "tcp://h:99999",
     "tcp://user@h:1", "tcp://h:1/path", "h", "tcp://h: 1", "inproc://x"],
)  # fmt: skip
def test_malformed_receive_urls_are_400_naming_the_field(server: Server, url: str) -> None:
    response = server.post("/send", {"req_id": "a", "receive_url": url})
    assert_refused(response, 400, "receive_url")
    response = server.post(
        "/scheduler_receive_url", {"req_id": "a", "receive_count": 1, "receive_url": [url]}
    )
    assert_refused(response, 400, "receive_url[0]")


@pytest.mark.parametrize(
    "req_id", ["x" * 257, "x" * 1_000_000, "a b", "caf\u00e9", "a\x01", "\u202e"], ids=repr
)
def test_req_ids_are_bounded_in_length_and_charset(server: Server, req_id: str) -> None:
    response = server.post("/release", {"req_id": req_id})
    assert_refused(response, 400, "req_id")
    assert response.json()["req_id"] is None, "a refused id is never echoed"


def test_an_empty_data_url_is_400_without_an_address(server: Server) -> None:
    if not server.tiny:
        pytest.skip("the null model decodes nothing")
    for item in ("data:image/png;base64,", "data:image/png;base64,AAAA"):
        response = server.post("/encode", {"req_id": "empty", "mm_items": [item]})
        assert_refused(response, 400, "mm_items[0]")


def test_json_with_a_charset_and_a_valid_body_still_works(server: Server) -> None:
    body = json.dumps({"req_id": "ok-1", "mm_items": [IMAGE]}).encode()
    response = server.post(
        "/encode", body, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert response.status_code == 200, response.text
    assert server.post("/release", {"req_id": "ok-1"}).status_code == 200


def test_remembered_ids_are_bounded_and_shown_in_metrics(server: Server) -> None:
    long_ids = [f"{n}-" + "r" * 250 for n in range(8)]
    for req_id in long_ids:
        # Never seen: remembered as abandoned, so a late encode of it is refused.
        assert server.post("/release", {"req_id": req_id}).status_code == 200
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("encdisagg_retired_ids", "encdisagg_retired_bytes"))
    }
    assert values["encdisagg_retired_ids"] >= 1
    # Each remembered id costs its text plus a bounded overhead, and no more.
    assert 0 < values["encdisagg_retired_bytes"] <= values["encdisagg_retired_ids"] * 1024


def test_no_body_gets_a_5xx(server: Server) -> None:
    bodies = [
        b"", b"null", b"[]", b"{}", b'"x"', b"1", b"\xff", b"{" * 5000, b'{"req_id": {}}',
        b'{"req_id": "a", "mm_items": [{}]}', b'{"req_id": "a", "mm_items": [[[[[]]]]]}',
        b'{"req_id": "a", "mm_items": ["x"], "hashes": [' + b'"h",' * 2 + b'"h"]}',
        b'{"req_id": "a", "receive_url": ["tcp://h:1"]}',
    ]  # fmt: skip
    for route in ROUTES:
        for body in bodies:
            response = server.post(route, body)
            assert response.status_code < 500, (route, body[:40], response.text)


# --- sockets ---------------------------------------------------------------------------------


def _one_request(host: str, port: int) -> bytes:
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: encdisagg\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            if not chunk:
                break
            head += chunk
    return head.split(b"\r\n", 1)[0]


def test_closed_connections_release_their_descriptors(server: Server) -> None:
    """More one-request connections than the server may hold descriptors: each closed
    connection must be closed by the server too, not kept for the keep-alive."""
    url = httpx.URL(server.url)
    assert url.port is not None
    for _ in range(3 * DESCRIPTORS):
        assert _one_request(url.host, url.port) == b"HTTP/1.1 200 "
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
