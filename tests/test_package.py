"""The public surface: exports, errors, config, command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import encdisagg
from encdisagg import (
    BadRequestError,
    ConfigError,
    EncdisaggError,
    EncoderConfig,
    InternalError,
    NotFoundError,
    RequestNotActiveError,
    RequestTimeoutError,
    ServiceUnavailableError,
    TransferError,
    TransferTimeoutError,
)
from encdisagg._cli import main
from encdisagg._errors import WIRE_ANSWERS, error_of_status, grpc_code_of


def test_every_export_exists_and_claims_a_public_module() -> None:
    for name in encdisagg.__all__:
        obj = getattr(encdisagg, name)
        if isinstance(obj, type):
            assert not any(part.startswith("_") for part in obj.__module__.split(".")), name


def test_import_stays_light() -> None:
    code = "import sys, encdisagg; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("cls", "status"),
    [
        (EncdisaggError, 500),
        (BadRequestError, 400),
        (NotFoundError, 404),
        (RequestNotActiveError, 409),
        (RequestTimeoutError, 504),
        (TransferError, 502),
        (ServiceUnavailableError, 503),
        (InternalError, 500),
    ],
)
def test_error_statuses(cls: type[EncdisaggError], status: int) -> None:
    error = cls("req_id 'x' is unknown", req_id="x")
    assert error.status == status
    assert isinstance(error, EncdisaggError)
    assert str(error) == "req_id 'x' is unknown"
    assert error.req_id == "x"


def test_one_table_answers_each_error_on_every_wire() -> None:
    for cls, (status, code) in WIRE_ANSWERS.items():
        assert cls.status == status, cls
        assert grpc_code_of(cls("m")) == code, cls
    # An error answers as its nearest listed class; anything else is internal.
    assert grpc_code_of(ConfigError("model is unknown")) == "INVALID_ARGUMENT"
    assert grpc_code_of(TransferTimeoutError("m")) == "DEADLINE_EXCEEDED"
    assert grpc_code_of(ValueError("m")) == "INTERNAL"
    # The way back: the first class answering a status; internal for any other or none.
    assert error_of_status(504) is RequestTimeoutError
    assert error_of_status(502) is TransferError
    assert error_of_status(500) is InternalError
    assert error_of_status(418) is InternalError
    assert error_of_status(None) is InternalError


def test_config_defaults_match_the_contract() -> None:
    config = EncoderConfig()
    assert config.model == "tiny"
    assert config.transfer == "zmq"
    assert config.max_batch_size == 8
    assert config.request_timeout_s == 180
    assert config.send_timeout_s == 180
    assert config.prefix_cache_mb == 0
    assert config.staged_memory_limit_mb is None
    assert config.default_receive_count == 1


def test_config_is_frozen() -> None:
    config = EncoderConfig()
    with pytest.raises(AttributeError):
        config.model = "other"  # type: ignore[misc]


def test_from_mapping_rejects_unknown_keys_by_name() -> None:
    with pytest.raises(BadRequestError, match="max_batch, modle"):
        EncoderConfig.from_mapping({"modle": "tiny", "max_batch": 3})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"transfer": "carrier-pigeon"}, "transfer"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"request_timeout_s": -1.5}, "request_timeout_s"),
        ({"send_timeout_s": float("nan")}, "send_timeout_s"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"max_batch_size": "8"}, "max_batch_size"),
        ({"prefix_cache_mb": -1}, "prefix_cache_mb"),
        ({"staged_memory_limit_mb": 0}, "staged_memory_limit_mb"),
        ({"default_receive_count": 0}, "default_receive_count"),
        ({"model": ""}, "model"),
        ({"mooncake_protocol": "udp"}, "mooncake_protocol"),
        ({"mooncake_poll_on_loop_s": -0.1}, "mooncake_poll_on_loop_s"),
        ({"mooncake_poll_on_loop_s": float("nan")}, "mooncake_poll_on_loop_s"),
        ({"mooncake_poll_on_loop_s": float("inf")}, "mooncake_poll_on_loop_s"),
    ],
)
def test_invalid_values_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(BadRequestError, match=field):
        EncoderConfig.from_mapping(changes)


def test_config_round_trips_and_reads_toml(tmp_path: Path) -> None:
    config = EncoderConfig(max_batch_size=4, remote_media_domains=("example.org",))
    assert EncoderConfig.from_mapping(config.to_mapping()) == config
    assert config.replace(transfer="loopback").transfer == "loopback"
    path = tmp_path / "encoder.toml"
    path.write_text('[encoder]\nmodel = "tiny"\nmax_batch_size = 2\nsend_timeout_s = 5\n')
    assert EncoderConfig.from_toml(path).max_batch_size == 2
    path.write_text("[encoder]\nunknown_key = 1\n")
    with pytest.raises(BadRequestError, match="unknown_key"):
        EncoderConfig.from_toml(path)


def test_cli_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert encdisagg.__version__ in capsys.readouterr().out
    assert main([]) == 2
    assert "usage: encdisagg" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "encdisagg", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0
    assert "encdisagg" in done.stdout
