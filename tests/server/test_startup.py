"""Startup failures of ``encdisagg serve``: one line naming the root cause, exit non-zero."""

from __future__ import annotations

import asyncio
import errno
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypercorn.utils import LifespanFailureError

from encdisagg import BadRequestError
from encdisagg.server._dp._ipc import MalformedMessage, ReplyMessage
from encdisagg.server._serve._startup import describe_startup_failure

#: Bound on one ``serve`` subprocess that fails to start (imports torch, maybe spawns workers).
_SERVE_TIMEOUT_S = 90


def _busy(code: int = errno.EADDRINUSE) -> OSError:
    return OSError(code, "Address already in use")


def test_a_busy_port_inside_nested_task_groups_is_one_line() -> None:
    nested = ExceptionGroup(
        "unhandled errors in a TaskGroup",
        [ExceptionGroup("Exceptions from Trio nursery", [_busy()])],
    )
    assert describe_startup_failure(nested, host="127.0.0.1", port=8000) == (
        "127.0.0.1:8000 is already in use"
    )
    assert describe_startup_failure(_busy(), host="::1", port=80) == "[::1]:80 is already in use"


def test_cancellations_beside_the_cause_are_no_cause() -> None:
    group = BaseExceptionGroup("x", [asyncio.CancelledError(), _busy(), asyncio.CancelledError()])
    assert (
        describe_startup_failure(group, host="127.0.0.1", port=1) == "127.0.0.1:1 is already in use"
    )


def test_other_bind_errors_name_the_address() -> None:
    denied = describe_startup_failure(_busy(errno.EACCES), host="0.0.0.0", port=80)
    assert denied.startswith("cannot serve on 0.0.0.0:80: permission denied")
    unknown = describe_startup_failure(socket.gaierror(-2, "nope"), host="nohost", port=1)
    assert unknown == "cannot serve on nohost:1: unknown host 'nohost'"


def test_the_apps_lifespan_message_is_unquoted() -> None:
    failure = LifespanFailureError("startup", "encdisagg: model: no such\nthing")
    group = ExceptionGroup("unhandled errors in a TaskGroup", [failure])
    assert describe_startup_failure(group) == "model: no such thing"


def test_distinct_causes_are_joined_and_errors_give_their_message() -> None:
    group = ExceptionGroup(
        "g", [BadRequestError("model: bad"), BadRequestError("model: bad"), KeyError("k")]
    )
    assert describe_startup_failure(group) == "model: bad; KeyError: 'k'"


def test_a_workers_failure_report_round_trips_and_is_strict() -> None:
    wire = ReplyMessage("failed", 1, reason="model: bad").to_wire()
    assert wire == {"kind": "failed", "rank": 1, "reason": "model: bad"}
    assert ReplyMessage.from_wire(wire) == ReplyMessage("failed", 1, reason="model: bad")
    with pytest.raises(MalformedMessage):
        ReplyMessage.from_wire({**wire, "extra": 1})
    with pytest.raises(MalformedMessage):
        ReplyMessage.from_wire({**wire, "reason": 3})


# --- the real command ------------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _serve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "encdisagg", "serve", "--model", "null", *argv],
        capture_output=True,
        text=True,
        timeout=_SERVE_TIMEOUT_S,
        check=False,
    )


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "extra",
    [("--worker-class", "asyncio"), ("--worker-class", "trio"), ("--dp", "2")],
    ids=["asyncio", "trio", "dp2"],
)
def test_serve_on_a_busy_port_prints_one_line(busy_port: int, extra: tuple[str, ...]) -> None:
    done = _serve("--port", str(busy_port), *extra)
    assert done.returncode == 1
    assert _lines(done.stderr) == [
        f"encdisagg serve: error: 127.0.0.1:{busy_port} is already in use"
    ]


def test_a_model_folder_without_config_json_is_refused_in_one_line(tmp_path: Path) -> None:
    done = _serve("--port", "0", "--dp", "2", "--model", str(tmp_path))
    assert done.returncode == 2
    assert _lines(done.stderr) == [
        f"encdisagg serve: error: --model: model folder {tmp_path} has no config.json"
    ]


def test_a_model_that_fails_to_load_in_a_worker_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "nope"}')
    done = _serve("--port", "0", "--model", str(tmp_path), "--dp", "2")
    assert done.returncode == 1
    *progress, last = _lines(done.stderr)
    # Before it: the startup's progress records, nothing else.
    assert all(" INFO encdisagg." in line for line in progress), done.stderr
    lines = [last]
    assert lines[0].startswith("encdisagg serve: error: data-parallel worker ")
    assert "could not start: " in lines[0]
    assert f"model: {str(tmp_path)!r} is a 'nope' checkpoint" in lines[0]
    assert "TaskGroup" not in lines[0]
    assert "nursery" not in lines[0]
