"""``encdisagg serve --wire vllm``: its flags, their environment variables, their checks."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from encdisagg._cli import build_parser
from encdisagg._cli._serve import ServeOptions, UsageError, resolve

from .._serve_cli import serving
from ._bodies import chat_body, image_item


def resolved(*argv: str, environ: dict[str, str] | None = None) -> ServeOptions:
    return resolve(build_parser().parse_args(["serve", *argv]), environ or {})


def test_flags_and_environment() -> None:
    settings = resolved(
        "--wire",
        "vllm",
        "--vllm-storage-path",
        "store",
        "--vllm-store-max-bytes",
        "1000",
        environ={"ENCDISAGG_VLLM_STORE_MAX_AGE": "60", "ENCDISAGG_VLLM_DTYPE": "bf16"},
    ).settings
    assert settings.wire == "vllm"
    assert settings.vllm_connector == "example"
    assert settings.vllm_storage_path == "store"
    assert settings.vllm_store_max_bytes == 1000
    assert settings.vllm_store_max_age_s == 60.0
    assert settings.vllm_dtype == "bf16"
    pushed = resolved(
        "--wire",
        "vllm",
        "--vllm-connector",
        "mooncake",
        "--transfer",
        "mooncake",
        "--vllm-control-timeout",
        "5",
        "--vllm-refresh-after",
        "100",
    ).settings
    assert (pushed.vllm_control_timeout_s, pushed.vllm_refresh_after_s) == (5.0, 100.0)


def test_toml_keys(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(
        '[server]\nwire = "vllm"\nvllm_connector = "example"\nvllm_storage_path = "/x"\n'
        "vllm_store_max_bytes = 8589934592\nvllm_store_max_age_s = 3600.0\n"
        'vllm_dtype = "bfloat16"\n'
    )
    settings = resolved("--config", str(path)).settings
    assert (settings.wire, settings.vllm_storage_path, settings.vllm_dtype) == (
        "vllm",
        "/x",
        "bfloat16",
    )
    assert settings.vllm_store_max_bytes == 8 * 1024**3


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--wire", "vllm"), "vllm_storage_path is needed"),
        (("--wire", "vllm", "--vllm-connector", "nfs"), "--vllm-connector: vllm_connector must"),
        (("--vllm-store-max-bytes", "0"), "--vllm-store-max-bytes: vllm_store_max_bytes must"),
        (("--vllm-store-max-age", "0"), "--vllm-store-max-age: vllm_store_max_age_s must"),
        (("--vllm-dtype", "int8"), "--vllm-dtype: vllm_dtype must be one of"),
    ],
)
def test_bad_values_name_their_flag(argv: tuple[str, ...], says: str) -> None:
    with pytest.raises(UsageError) as caught:
        resolved(*argv)
    assert says in str(caught.value)


def test_the_command_line_answers_the_proxy(tmp_path: Path) -> None:
    flags = ("--model=tiny", "--wire=vllm", f"--vllm-storage-path={tmp_path}")
    with serving(*flags, worker_class="asyncio") as server:
        response = httpx.post(
            f"{server.url}/v1/chat/completions",
            json=chat_body(image_item("c")),
            headers={"x-request-id": "req-1:0:abcdef"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert (tmp_path / "c" / "encoder_cache.safetensors").is_file()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
