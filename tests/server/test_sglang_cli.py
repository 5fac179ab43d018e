"""``encdisagg serve --wire sglang --register-with URL``: flags, TOML keys, the advertised URL."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from encdisagg._cli import build_parser
from encdisagg._cli._serve import ServeOptions, UsageError, resolve


def resolved(*argv: str) -> ServeOptions:
    return resolve(build_parser().parse_args(["serve", *argv]))


def test_the_default_wire_is_ours() -> None:
    settings = resolved().settings
    assert settings.wire == "encdisagg"
    assert settings.register_with is None


def test_register_with_advertises_this_server() -> None:
    settings = resolved(
        "--wire", "sglang", "--register-with", "http://tok:8997", "--port", "30000"
    ).settings
    assert settings.wire == "sglang"
    assert settings.register_with == "http://tok:8997"
    assert settings.advertise_url == "http://127.0.0.1:30000"
    everywhere = resolved(
        "--wire", "sglang", "--register-with", "http://tok:8997", "--host", "0.0.0.0"
    ).settings
    assert everywhere.advertise_url == f"http://{socket.gethostname()}:8000"
    given = resolved(
        "--wire", "sglang", "--register-with", "http://tok:8997", "--advertise-url", "http://e:1"
    ).settings
    assert given.advertise_url == "http://e:1"


def test_toml_keys(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(
        '[server]\nwire = "sglang"\nregister_with = "http://tok:8997"\n'
        'advertise_url = "http://enc-0:30000"\n'
    )
    settings = resolved("--config", str(path)).settings
    assert (settings.wire, settings.register_with, settings.advertise_url) == (
        "sglang",
        "http://tok:8997",
        "http://enc-0:30000",
    )


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (("--register-with", "http://tok:8997"), "--register-with: register_with needs"),
        (
            ("--wire", "sglang", "--register-with", "http://tok:8997", "--port", "0"),
            "--advertise-url, or a --port other than 0",
        ),
        (("--wire", "sglang", "--register-with", "tok:8997"), "--register-with: register_with"),
    ],
)
def test_invalid_combinations_name_the_flag(argv: tuple[str, ...], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        resolved(*argv)


def test_an_unknown_wire_is_refused_naming_the_flag() -> None:
    with pytest.raises(UsageError, match="--wire: wire must be one of encdisagg, sglang"):
        resolved("--wire", "grpc")
