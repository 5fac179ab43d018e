"""The global_cache URL: every part parsed strictly, errors naming the part."""

from __future__ import annotations

import pytest

from encdisagg import BadRequestError
from encdisagg.cache import GlobalCacheSettings, parse_global_cache_url

META = "metadata=http://127.0.0.1:18081/metadata"


def test_the_documented_example_parses() -> None:
    settings = parse_global_cache_url(
        f"mooncake://127.0.0.1:50051?{META}&protocol=tcp&segment_mb=64&buffer_mb=64"
    )
    assert settings == GlobalCacheSettings(
        master="127.0.0.1:50051",
        metadata="http://127.0.0.1:18081/metadata",
        protocol="tcp",
        segment_mb=64,
        buffer_mb=64,
    )
    assert (settings.master_host, settings.master_port) == ("127.0.0.1", 50051)


def test_defaults_and_every_parameter() -> None:
    settings = parse_global_cache_url(f"mooncake://127.0.0.1:1?{META}", default_host="10.0.0.5")
    assert settings.host == "10.0.0.5"
    assert (settings.segment_mb, settings.timeout_ms, settings.failures) == (64, 1000, 3)
    settings = parse_global_cache_url(
        f"mooncake://[::1]:9/?{META}&segment_mb=0&buffer_mb=8&host=127.0.0.1&device=mlx5_0"
        "&timeout_ms=250&failures=5&cooldown_s=2.5&max_pending_inserts=7&protocol=rdma"
    )
    assert settings.master == "[::1]:9"
    assert settings.master_host == "::1"
    assert (settings.segment_mb, settings.buffer_mb, settings.host) == (0, 8, "127.0.0.1")
    assert (settings.device, settings.protocol, settings.timeout_s) == ("mlx5_0", "rdma", 0.25)
    assert (settings.failures, settings.cooldown_s, settings.max_pending_inserts) == (5, 2.5, 7)


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("", "global_cache"),
        (f"redis://127.0.0.1:1?{META}", "scheme"),
        (f"127.0.0.1:1?{META}", "scheme"),
        (f"mooncake://127.0.0.1?{META}", "master address"),
        (f"mooncake://127.0.0.1:0?{META}", "master address"),
        (f"mooncake://127.0.0.1:99999?{META}", "master address"),
        (f"mooncake://:50051?{META}", "master address"),
        (f"mooncake://user@127.0.0.1:1?{META}", "master address"),
        (f"mooncake://127.0.0.1:1/path?{META}", "path"),
        (f"mooncake://127.0.0.1:1?{META}#frag", "fragment"),
        ("mooncake://127.0.0.1:1", "'metadata'"),
        ("mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE", "'metadata'"),
        ("mooncake://127.0.0.1:1?metadata=ftp://x:1/m", "'metadata'"),
        ("mooncake://127.0.0.1:1?metadata=http://x:bad/m", "'metadata'"),
        (f"mooncake://127.0.0.1:1?{META}&{META}", "'metadata'"),
        (f"mooncake://127.0.0.1:1?{META}&protocol=udp", "'protocol'"),
        (f"mooncake://127.0.0.1:1?{META}&segment_mb=-1", "'segment_mb'"),
        (f"mooncake://127.0.0.1:1?{META}&segment_mb=1.5", "'segment_mb'"),
        (f"mooncake://127.0.0.1:1?{META}&buffer_mb=0", "'buffer_mb'"),
        (f"mooncake://127.0.0.1:1?{META}&timeout_ms=", "'timeout_ms'"),
        (f"mooncake://127.0.0.1:1?{META}&failures=0", "'failures'"),
        (f"mooncake://127.0.0.1:1?{META}&cooldown_s=0", "'cooldown_s'"),
        (f"mooncake://127.0.0.1:1?{META}&cooldown_s=nan", "'cooldown_s'"),
        (f"mooncake://127.0.0.1:1?{META}&cooldown_s=inf", "'cooldown_s'"),
        (f"mooncake://127.0.0.1:1?{META}&host=a b", "'host'"),
        (f"mooncake://127.0.0.1:1?{META}&segmentmb=1", "'segmentmb' is unknown"),
        (f"mooncake://127.0.0.1:1?{META}&&", "query"),
    ],
)
def test_each_bad_part_is_named(url: str, names: str) -> None:
    with pytest.raises(BadRequestError, match=names) as caught:
        parse_global_cache_url(url)
    assert caught.value.status == 400
    assert caught.value.message.startswith("global_cache")
