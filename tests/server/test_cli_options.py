"""``encdisagg serve``'s options before anything loads: environment variables and their
precedence, every error at once, ``--check``, "did you mean", and no torch until valid."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from encdisagg._cli import build_parser, main
from encdisagg._cli._flag_table import FLAGS
from encdisagg._cli._resolve import ServeOptions, UsageError, resolve
from encdisagg._model_names import BUILTIN_MODEL_NAMES, SERVER_MODEL_NAMES


def resolved(*argv: str, env: dict[str, str] | None = None) -> ServeOptions:
    return resolve(build_parser().parse_args(["serve", *argv]), env or {})


# --- what runs before torch ------------------------------------------------------------------

#: Runs the command line in a fresh interpreter and reports, when it returns, whether torch
#: was imported meanwhile.
_PROBE = """
import sys
from encdisagg._cli import main
code = main(sys.argv[1:])
print(code, 'torch' in sys.modules, flush=True)
"""


def _probe(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, "serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_bad_flags_are_refused_before_torch_is_imported() -> None:
    done = _probe("--port", "notaport", "--max-batch-size", "0", "--model", "null")
    assert done.stdout.split() == ["2", "False"]
    assert done.stderr.splitlines() == [
        "encdisagg serve: error: 2 errors:",
        "  --port: expected an integer; got 'notaport'",
        "  --max-batch-size: max_batch_size must be at least 1; got 0",
    ]


def test_a_valid_check_imports_no_torch_either(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[encoder]\nmodel = "null"\n[server]\nport = 9001\n')
    done = _probe("--config", str(path), "--check")
    assert done.stdout.splitlines()[-1] == "0 False"


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_busy_port_is_found_before_the_server_loads(busy_port: int) -> None:
    done = _probe("--port", str(busy_port), "--model", "null")
    assert done.stdout.split() == ["1", "False"]
    assert done.stderr == f"encdisagg serve: error: 127.0.0.1:{busy_port} is already in use\n"


def test_the_importable_surface_stays_light() -> None:
    code = (
        "import sys, encdisagg, encdisagg._cli, encdisagg.server, "
        "encdisagg._cli._serve; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "False"


def test_the_model_names_match_the_loaders() -> None:
    from encdisagg.models import BUILTIN_MODELS
    from encdisagg.server._backend import SERVER_MODELS

    assert BUILTIN_MODEL_NAMES == BUILTIN_MODELS
    assert SERVER_MODEL_NAMES == SERVER_MODELS


# --- environment variables -------------------------------------------------------------------


def test_every_flag_is_in_the_table_and_has_a_variable() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    dests = {a.dest for a in serve._actions if a.option_strings and a.dest not in ("help", "check")}
    assert dests == {flag.dest for flag in FLAGS}
    assert {flag.env for flag in FLAGS} >= {"ENCDISAGG_PORT", "ENCDISAGG_MAX_BATCH_SIZE"}


def test_flag_over_environment_over_file_over_default(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text("[encoder]\nmax_batch_size = 3\nprefix_cache_mb = 5\n[server]\nport = 9001\n")
    env = {"ENCDISAGG_MAX_BATCH_SIZE": "4", "ENCDISAGG_PORT": "9002", "ENCDISAGG_DP": "2"}
    options = resolved("--config", str(path), "--port", "9003", "--model", "null", env=env)
    assert options.port == 9003, "the flag wins over the variable and the file"
    assert options.config.max_batch_size == 4, "the variable wins over the file"
    assert options.config.prefix_cache_mb == 5, "the file wins over the default"
    assert options.settings.dp == 2
    assert options.config.send_timeout_s == 180.0, "the default"
    assert dict(options.sources)["server.port"] == "--port"
    assert dict(options.sources)["encoder.max_batch_size"] == "ENCDISAGG_MAX_BATCH_SIZE"
    assert dict(options.sources)["encoder.prefix_cache_mb"] == f"{path}: encoder.prefix_cache_mb"


def test_the_config_file_and_booleans_and_lists_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[encoder]\nmodel = "null"\n')
    env = {
        "ENCDISAGG_CONFIG": str(path),
        "ENCDISAGG_FREEZE_HEAP": "no",
        "ENCDISAGG_ALLOWED_PEERS": "10.0.0.0/8, ::1",
        "ENCDISAGG_WORKER_CLASS": "trio",
        "ENCDISAGG_REQUEST_TIMEOUT": "7.5",
    }
    options = resolved(env=env)
    assert options.config.model == "null"
    assert options.settings.freeze_heap is False
    assert options.settings.allowed_peers == ("10.0.0.0/8", "::1")
    assert (options.worker_class, options.config.request_timeout_s) == ("trio", 7.5)
    assert resolved("--freeze-heap", env=env).settings.freeze_heap is True


@pytest.mark.parametrize(
    ("name", "value", "line"),
    [
        ("ENCDISAGG_PORT", "http", "ENCDISAGG_PORT: expected an integer; got 'http'"),
        ("ENCDISAGG_PORT", "99999", "ENCDISAGG_PORT: port must be in [0, 65535]; got 99999"),
        ("ENCDISAGG_FREEZE_HEAP", "maybe", "ENCDISAGG_FREEZE_HEAP: expected true or false"),
        ("ENCDISAGG_TRANSFER", "ftp", "ENCDISAGG_TRANSFER: transfer must be one of zmq,"),
        ("ENCDISAGG_MODEL", "nope", "ENCDISAGG_MODEL: model 'nope' is neither a built-in model"),
        ("ENCDISAGG_CONFIG", "/no/such.toml", "--config: cannot read /no/such.toml"),
    ],
)
def test_an_invalid_variable_is_named(name: str, value: str, line: str) -> None:
    with pytest.raises(UsageError) as caught:
        resolved(env={name: value})
    assert caught.value.problems[0].startswith(line), caught.value.problems


# --- flags: several errors, "did you mean", --check ------------------------------------------


def test_several_bad_flags_are_reported_together(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--port", "-1", "--transfer", "ftp", "--dp", "0", "--log-level", "loud"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "encdisagg serve: error: 4 errors:",
        "  --transfer: transfer must be one of zmq, mooncake, loopback; got 'ftp'",
        "  --log-level: log_level must be one of debug, info, warning, error, critical; got 'loud'",
        "  --port: port must be in [0, 65535]; got -1",
        "  --dp: dp must be a positive integer; got 0",
    ]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prot", "1"], "unrecognized argument --prot (did you mean --port?)"),
        (["--max-batch-sise=3"], "unrecognized argument --max-batch-sise=3 (did you mean"),
        (["--max-batch", "3"], "unrecognized argument --max-batch (did you mean --max-batch-size"),
        (["--zzzzzz"], "unrecognized argument --zzzzzz"),
    ],
)
def test_a_mistyped_flag_gets_a_suggestion_and_no_abbreviation_counts(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2
    assert f"encdisagg serve: error: {needle}" in capsys.readouterr().err


def test_check_prints_what_would_serve(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--check", "--model", "null", "--port", "9009", "--api-key", "secret"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("encdisagg serve: the options are valid\n")
    assert "http://127.0.0.1:9009 on asyncio" in out
    assert "server.port = 9009  (--port)" in out
    assert "secret" not in out


def test_check_lists_every_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "serve.toml"
    path.write_text("[server]\nprot = 1\n")
    assert main(["serve", "--check", "--config", str(path), "--dp", "zero"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("encdisagg serve: error: 2 errors:\n")
    assert "unknown key server.prot (did you mean server.port?)" in err
    assert "--dp: expected an integer; got 'zero'" in err


# --- progress while starting -----------------------------------------------------------------


def test_startup_progress_is_logged_in_the_chosen_format() -> None:
    command = [
        sys.executable, "-m", "encdisagg", "serve", "--port", "0", "--model", "null",
        "--log-format", "json", "--transfer", "mooncake",
    ]  # fmt: skip
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            banner = json.loads(process.stdout.readline())  # JSON on stdout too
            assert banner["message"] == f"encdisagg serving on {banner['url']}"
            assert banner["url"].startswith("http://127.0.0.1:")
        finally:
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=60)
    assert process.returncode == 0
    messages = [json.loads(line)["message"] for line in err.splitlines() if line.strip()]
    assert messages[0].startswith("listening on 127.0.0.1:")
    # Mooncake's own glog lines are records too: every line of stderr parsed as JSON above.
    assert "opening the encoder (model null, transfer mooncake)" in messages
