"""Mooncake's glog lines: quiet at start-up (debug records, or their own level when the start
fails), MC_LOG_LEVEL defaulted to WARNING unless the user set it or asked for debug."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from encdisagg.transfer._mooncake._native_logs import (
    NATIVE_LOGGER,
    native_lines_to_logging,
    quiet_mooncake_by_default,
    relog_native_lines,
)

_START_UP = (
    "WARNING: Logging before InitGoogleLogging() is written to STDERR\n"
    "W1201 14:04:37.497299 23460 transfer_engine_py.cpp:120] Using default malloc/free\n"
    "E1201 14:04:37.497774 23460 transfer_metadata.cpp:1098] Local segment descriptor not found\n"
    "someone else's line\n"
)


@pytest.fixture
def no_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    monkeypatch.delenv("ENCDISAGG_MC_LOG_LEVEL_DEFAULTED", raising=False)


def _native(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == NATIVE_LOGGER]


def test_a_good_start_logs_every_glog_line_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, NATIVE_LOGGER)
    rest = relog_native_lines(_START_UP, failed=False)
    assert rest == "someone else's line\n"
    assert _native(caplog) == [
        (
            logging.DEBUG,
            "mooncake: WARNING: Logging before InitGoogleLogging() is written to STDERR",
        ),
        (logging.DEBUG, "mooncake W transfer_engine_py.cpp:120: Using default malloc/free"),
        (
            logging.DEBUG,
            "mooncake E transfer_metadata.cpp:1098: Local segment descriptor not found",
        ),
    ]


def test_a_failed_start_logs_them_at_their_own_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, NATIVE_LOGGER)
    relog_native_lines(_START_UP, failed=True)
    assert [level for level, _ in _native(caplog)] == [
        logging.DEBUG,
        logging.WARNING,
        logging.ERROR,
    ]


@pytest.mark.usefixtures("no_level")
def test_the_level_defaults_to_warning_unless_debug_or_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    quiet_mooncake_by_default(debug=True)
    assert "MC_LOG_LEVEL" not in os.environ
    quiet_mooncake_by_default(debug=False)
    assert os.environ["MC_LOG_LEVEL"] == "WARNING"
    monkeypatch.setenv("MC_LOG_LEVEL", "TRACE")
    monkeypatch.delenv("ENCDISAGG_MC_LOG_LEVEL_DEFAULTED")
    quiet_mooncake_by_default(debug=False)
    assert os.environ["MC_LOG_LEVEL"] == "TRACE", "the user's level stays"


@pytest.mark.usefixtures("no_level")
def test_descriptor_2_is_captured_and_relogged(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, NATIVE_LOGGER)
    with native_lines_to_logging():
        os.write(2, _START_UP.encode())
    assert capfd.readouterr().err == "someone else's line\n"
    assert len(_native(caplog)) == 3
    # A failing start: the exception passes, the lines are logged at their level.
    caplog.clear()
    with pytest.raises(RuntimeError, match="initialize failed"):
        _failing_start()
    assert logging.ERROR in [level for level, _ in _native(caplog)]
    # The user's own level: nothing is captured.
    os.environ["MC_LOG_LEVEL"] = "INFO"
    try:
        with native_lines_to_logging():
            os.write(2, b"I1201 14:04:37.497299 1 x.cpp:1] raw\n")
    finally:
        del os.environ["MC_LOG_LEVEL"]
    assert "raw" in capfd.readouterr().err


def _failing_start() -> None:
    with native_lines_to_logging():
        os.write(2, _START_UP.encode())
        raise RuntimeError("initialize failed")


_START_ENGINE = """
import anyio
from encdisagg.server._serve._noise import quiet_third_party
from encdisagg.transfer import MooncakeEngine
quiet_third_party("info")
async def main():
    async with MooncakeEngine() as engine:
        print("session", engine.session_id, flush=True)
anyio.run(main)
"""


@pytest.mark.mooncake
@pytest.mark.parametrize("user_level", [None, "INFO"])
def test_a_real_engine_start_prints_no_glog_line_unless_asked(user_level: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "ENCDISAGG_MC"))}
    if user_level is not None:
        env["MC_LOG_LEVEL"] = user_level
    done = subprocess.run(
        [sys.executable, "-c", _START_ENGINE], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("session 127.0.0.1:")
    glog = [line for line in done.stderr.splitlines() if line[:1] in "IWEF" and "] " in line]
    if user_level is None:
        assert glog == [], done.stderr
        assert "InitGoogleLogging" not in done.stderr
    else:
        assert any("Local segment descriptor not found" in line for line in glog), done.stderr
