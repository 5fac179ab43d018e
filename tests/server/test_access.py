"""Access control in process: the API key, the peer allow-list, the exposure warning, and
``mount_encoder(api_key=...)`` on an existing app of each flavour."""

from __future__ import annotations

import argparse
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from quart import Quart

from encdisagg import BadRequestError, MooncakeDestination, ZmqDestination
from encdisagg._cli._serve import resolve, warn_if_exposed
from encdisagg.server import ServerSettings, mount_encoder
from encdisagg.server._access import ApiKey, ForbiddenError, PeerAllowList, is_loopback_host

from ._helpers import fast_config, running


def test_the_api_key_is_compared_whole() -> None:
    key = ApiKey("s3cret")
    assert key.allows("Bearer s3cret")
    assert key.allows("bearer   s3cret ")
    for header in (None, "", "Bearer", "Bearer s3cre", "Bearer s3crett", "Basic s3cret", "s3cret"):
        assert not key.allows(header), header
    assert not key.allows("Bearer s3cr\u00e9t")
    assert "s3cret" not in repr(key)


@pytest.mark.parametrize("bad", ["", "has space", "tab\there", "caf\u00e9"])
def test_an_api_key_must_be_visible_ascii(bad: str) -> None:
    with pytest.raises(BadRequestError, match="api_key"):
        ServerSettings(api_key=bad)


def test_settings_never_show_the_key() -> None:
    assert "s3cret" not in repr(ServerSettings(api_key="s3cret"))


@pytest.fixture
def no_name_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the allow-list must not resolve names")

    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
        monkeypatch.setattr(socket, name, refuse)


@pytest.mark.usefixtures("no_name_lookups")
def test_the_allow_list_matches_networks_and_names_without_lookups() -> None:
    peers = PeerAllowList.parse(["10.0.0.0/8", "192.168.1.7", "fd00::/8", "Prefill-0.internal"])
    assert peers.allows_host("10.200.3.4")
    assert peers.allows_host("192.168.1.7")
    assert not peers.allows_host("192.168.1.8")
    assert peers.allows_host("fd00::1")
    assert peers.allows_host("[fd00::1]")
    assert peers.allows_host("::ffff:10.0.0.1"), "an IPv4-mapped address is its IPv4 address"
    assert peers.allows_host("prefill-0.INTERNAL")
    assert not peers.allows_host("prefill-1.internal")
    assert not peers.allows_host("localhost")
    peers.check("session_id", "10.0.0.1:17000")
    peers.check_destination(ZmqDestination("tcp://prefill-0.internal:5555"))
    for endpoint in ("11.0.0.1:1", "10.0.0.1", "10.0.0.1:0", "evil.example:1", "*:1", ""):
        with pytest.raises(ForbiddenError, match="session_id") as caught:
            peers.check("session_id", endpoint, req_id="r")
        assert caught.value.status == 403
        assert caught.value.req_id == "r"
    with pytest.raises(ForbiddenError, match="session_id"):
        peers.check_destination(MooncakeDestination("172.16.0.1:1", 4096, "172.16.0.1:2"))


@pytest.mark.parametrize("entry", ["", "10.0.0.0/33", "bad host", "a..b", "*"])
def test_allow_list_entries_are_checked(entry: str) -> None:
    with pytest.raises(BadRequestError, match="allowed_peers"):
        ServerSettings(allowed_peers=(entry,))
    with pytest.raises(BadRequestError, match="allowed_peers"):
        ServerSettings(allowed_peers="10.0.0.0/8")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("encoder-0", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_serving_beyond_loopback_without_a_key_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="encdisagg.server"):
        assert warn_if_exposed("0.0.0.0", ServerSettings())
        assert not warn_if_exposed("127.0.0.1", ServerSettings())
        assert not warn_if_exposed("0.0.0.0", ServerSettings(api_key="k"))
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1
    assert "without an API key" in messages[0]
    assert "ENCDISAGG_API_KEY" in messages[0]


def _namespace(config: Path | None = None, **flags: Any) -> argparse.Namespace:
    from encdisagg._cli import build_parser

    argv = ["serve"] + (["--config", str(config)] if config is not None else [])
    args = build_parser().parse_args(argv)
    for name, value in flags.items():
        setattr(args, name, value)
    return args


def test_the_key_and_peers_come_from_the_environment_and_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[server]\napi_key = "from-file"\nallowed_peers = ["10.0.0.0/8"]\n')
    monkeypatch.delenv("ENCDISAGG_API_KEY", raising=False)
    options = resolve(_namespace(path))
    assert options.settings.api_key == "from-file"
    assert options.settings.allowed_peers == ("10.0.0.0/8",)
    monkeypatch.setenv("ENCDISAGG_API_KEY", "from-env")
    assert resolve(_namespace(path)).settings.api_key == "from-env"
    # What the --api-key and --allowed-peers flags set, once the parser declares them.
    flagged = resolve(_namespace(path, api_key="from-flag", allowed_peers="127.0.0.1, ::1"))
    assert flagged.settings.api_key == "from-flag"
    assert flagged.settings.allowed_peers == ("127.0.0.1", "::1")
    monkeypatch.delenv("ENCDISAGG_API_KEY")
    assert resolve(_namespace()).settings.api_key is None


def _plain_app(flavour: str) -> Quart:
    if flavour == "trio":
        from quart_trio import QuartTrio

        return QuartTrio("embedding-app")
    return Quart("embedding-app")


@pytest.mark.anyio
async def test_mount_encoder_takes_the_key(flavour: str) -> None:
    app = _plain_app(flavour)

    @app.get("/mine")
    async def mine() -> str:
        return "mine"

    mount_encoder(app, fast_config(model="null"), url_prefix="/enc", api_key="k")
    async with running(app) as client:
        assert (await client.get("/mine")).status_code == 200, "the app's own routes are open"
        assert (await client.get("/enc/health")).status_code == 200
        assert (await client.get("/enc/metrics")).status_code == 200
        body = {"req_id": "m", "mm_items": ["x"]}
        response = await client.post("/enc/encode", json=body)
        assert response.status_code == 401
        response = await client.post(
            "/enc/encode", json=body, headers={"Authorization": "Bearer k"}
        )
        assert response.status_code == 200, await response.get_data()
        response = await client.post(
            "/enc/release", json={"req_id": "m"}, headers={"Authorization": "Bearer k"}
        )
        assert response.status_code == 200
