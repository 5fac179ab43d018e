"""``encdisagg serve --registry``: the flags and TOML keys, resolved without serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from encdisagg._cli import build_parser
from encdisagg._cli._serve import UsageError, resolve


def resolved(*argv: str):  # type: ignore[no-untyped-def]
    return resolve(build_parser().parse_args(["serve", "--model=null", *argv]))


def test_no_registry_by_default() -> None:
    settings = resolved().settings
    assert settings.registry is None
    assert settings.registry_lease_ttl_s == 5


def test_registry_flags_and_toml_keys(tmp_path: Path) -> None:
    settings = resolved(
        "--registry", "etcd://10.0.0.1:2379/fleet", "--registry-lease-ttl", "3"
    ).settings
    assert (settings.registry, settings.registry_lease_ttl_s) == ("etcd://10.0.0.1:2379/fleet", 3)
    path = tmp_path / "serve.toml"
    path.write_text('[server]\nregistry = "etcd://h:2379/a"\nregistry_lease_ttl_s = 7\n')
    settings = resolved("--config", str(path)).settings
    assert (settings.registry, settings.registry_lease_ttl_s) == ("etcd://h:2379/a", 7)
    # Flags win over the file.
    settings = resolved("--config", str(path), "--registry", "etcd://k:1/b").settings
    assert settings.registry == "etcd://k:1/b"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--registry", "http://h:2379/p"), "--registry: registry: the scheme must be etcd://"),
        (("--registry", "etcd://h/p"), "--registry: registry: the URL must name a port"),
        (("--registry-lease-ttl", "1"), "--registry-lease-ttl: registry_lease_ttl_s must be"),
    ],
)
def test_invalid_registry_options_name_their_flag(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(UsageError) as caught:
        resolved(*argv)
    assert str(caught.value).startswith(message)
