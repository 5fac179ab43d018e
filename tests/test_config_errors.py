"""Every configuration error at once: unknown keys and each invalid field, in one message."""

from __future__ import annotations

from pathlib import Path

import pytest

from encdisagg import BadRequestError, EncoderConfig
from encdisagg._cli import main


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
    assert err.startswith(f"encdisagg serve: error: --config: {path} has 5 errors:")
    for needle in (
        "unknown key server.prot",
        "server.dp has the wrong type",
        "unknown table or key sever",
        "[encoder] unknown configuration key(s): max_batch_sise",
        "[encoder] request_timeout_s must be a positive number",
    ):
        assert f"\n  {needle}" in err


def test_one_error_stays_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "serve.toml"
    path.write_text("max_batch_size = 0\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    expected = "max_batch_size must be at least 1; got 0"
    assert err == f"encdisagg serve: error: --config: {path}: {expected}\n"
