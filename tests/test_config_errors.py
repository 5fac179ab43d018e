"""Every configuration error at once: unknown keys and each invalid field, in one message."""

from __future__ import annotations

from pathlib import Path

import pytest

from encdisagg import BadRequestError, ConfigError, EncoderConfig
from encdisagg._cli import main
from encdisagg.receiver import EncoderClient


def test_every_invalid_field_and_unknown_key_is_reported_together() -> None:
    with pytest.raises(BadRequestError) as caught:
        EncoderConfig.from_mapping(
            {"max_batch_sise": 3, "max_batch_size": 0, "device": "tpu", "transfer": "ftp"}
        )
    lines = caught.value.message.splitlines()
    assert lines[0] == "unknown configuration key(s): max_batch_sise"
    assert [line.split(" ", 1)[0] for line in lines[1:]] == ["max_batch_size", "device", "transfer"]


def test_a_valid_mapping_has_no_problems() -> None:
    assert EncoderConfig.problems({"max_batch_size": 3}) == []
    problems = EncoderConfig.problems({"zmq_curve_server_keys": ["tcp://h:1 not-a-key"]})
    assert len(problems) == 1
    assert "zmq_curve_server_keys" in problems[0]


def test_a_toml_file_with_typos_in_two_tables_lists_them_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(
        "[encoder]\nmax_batch_sise = 3\nrequest_timeout_s = -1\n"
        '[server]\nprot = 8001\ndp = "two"\n'
        "[sever]\nhost = 1\n"
    )
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("encdisagg serve: error: 5 errors:\n")
    for needle in (
        "unknown key server.prot (did you mean server.port?)",
        "server.dp must be an integer, got a string",
        "unknown table or key sever (did you mean server?)",
        "unknown key encoder.max_batch_sise (did you mean encoder.max_batch_size?)",
        "encoder.request_timeout_s must be a positive number; got -1",
    ):
        assert f"\n  {path}: {needle}\n" in err


def test_one_error_stays_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "serve.toml"
    path.write_text("max_batch_size = 0\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    expected = "max_batch_size must be at least 1; got 0"
    assert err == f"encdisagg serve: error: {path}: {expected}\n"


@pytest.mark.parametrize(
    ("toml", "line"),
    [
        ('[server]\nport = "8000"\n', "server.port must be an integer, got a string"),
        ("[server]\nhealth_timeout_s = true\n", "server.health_timeout_s must be a number"),
        ("[server]\nfreeze_heap = 1\n", "server.freeze_heap must be true or false, got an"),
        ("[server]\ndevices = [0, 1]\n", "server.devices must be a list of strings, got an"),
        ('[server]\nallowed_peers = "10.0.0.0/8"\n', "server.allowed_peers must be a list"),
        ('[encoder]\nmax_batch_size = "3"\n', "encoder.max_batch_size must be an integer, got"),
        ("[encoder]\nsend_timeout_s = [1]\n", "encoder.send_timeout_s must be a number, got"),
        ('[server]\nlog_format = "xml"\n', "server.log_format must be one of text, json"),
        ("[server]\nport = 70000\n", "server.port must be in [0, 65535]; got 70000"),
        ("[server]\ndp = 0\n", "server.dp must be a positive integer; got 0"),
        ("[server]\nmax_body_mb = 0\n", "server.max_body_mb must be at least 1; got 0"),
        ('[encoder]\ndevice = "tpu"\n', "encoder.device must be one of cpu, cuda"),
        ("max_batch_sise = 1\n", "unknown key max_batch_sise (did you mean max_batch_size?)"),
    ],
)
def test_each_error_names_the_config_key_and_the_type_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, line: str
) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(toml)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"encdisagg serve: error: {path}: {line}"), err
    assert err.count("\n") == 1
    assert "--" not in err, "a value of the file is named by its key, not by a flag"


def test_errors_of_the_file_flags_and_environment_come_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[server]\ndp = "two"\n[encoder]\nprefix_cache_mb = -1\n')
    monkeypatch.setenv("ENCDISAGG_SEND_TIMEOUT", "soon")
    assert main(["serve", "--config", str(path), "--port", "x", "--max-batch-size", "0"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "encdisagg serve: error: 5 errors:"
    assert sorted(lines[1:]) == sorted(
        [
            f"  {path}: server.dp must be an integer, got a string",
            f"  {path}: encoder.prefix_cache_mb must be 0 or more; got -1",
            "  ENCDISAGG_SEND_TIMEOUT: expected a number; got 'soon'",
            "  --port: expected an integer; got 'x'",
            "  --max-batch-size: max_batch_size must be at least 1; got 0",
        ]
    )


def test_configuration_errors_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be at least 1") as caught:
        EncoderConfig(max_batch_size=0)
    assert isinstance(caught.value, ConfigError)
    with pytest.raises(ConfigError, match="urls: 'ftp://h' is not an http"):
        EncoderClient(["ftp://h"])


def test_an_unknown_model_name_is_refused_when_the_config_is_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        EncoderConfig(model="tiny-qwen3vl")
    assert caught.value.message.startswith("model 'tiny-qwen3vl' is neither a built-in model")
    assert caught.value.message.endswith("(did you mean tiny-qwen3-vl?)")
    # Folders and Hub ids are read when the model loads, not here.
    for model in ("tiny", "null", str(tmp_path), "Org/Name", "/models/absent"):
        assert EncoderConfig(model=model).model == model
