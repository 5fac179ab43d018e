"""Development sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s demo``, ``nox -s bench``,
``nox -s soak``, ``nox -s bench_peer`` (not run by default: it builds SGLang's venv to measure
against), ``nox -s interop`` and ``nox -s interop_vllm`` (SGLang's and vLLM's own code
against our servers; not run by default either), ``nox -s gpu`` (the GPU check, on a
machine with a GPU).

Every install goes through ``constraints.txt``: an unpinned torch can resolve to a multi-GB
CUDA build, so torch is installed first, pinned, and every later install is constrained to it.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint"]

PYTHON = "3.11"
CONSTRAINTS = ("-c", "constraints.txt")
ROOT = Path(__file__).resolve().parent


def install_project(session: nox.Session, *extras: str) -> None:
    session.install(*CONSTRAINTS, "torch")
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install(*CONSTRAINTS, "-e", spec)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite (asyncio and Trio) with the CPU Mooncake engine.

    Two pytest-xdist workers, each taking whole test files (a file's servers and models start
    once): the suite is mostly waits on subprocesses, servers and sockets, so two workers on
    two cores take about 60 % of the time one does. Arguments replace these defaults
    (``nox -s tests -- -q tests/encoder`` runs one worker).
    """
    install_project(session, "mooncake-cpu", "dev")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    defaults = ["-q", "--numprocesses", "2", "--dist", "loadfile"]
    session.run("pytest", *(session.posargs or defaults), env=env)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and mypy (strict on src/)."""
    install_project(session, "dev")
    linted = ("src", "tests", "examples", "benchmarks", "interop", "noxfile.py")
    session.run("ruff", "check", *linted)
    session.run("ruff", "format", "--check", *linted)
    session.run("mypy")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Run the E->P->D demo pipeline on the embedded tiny model."""
    install_project(session, "mooncake-cpu")
    session.run("encdisagg", "demo", *session.posargs, env={"HF_HUB_OFFLINE": "1"})


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run the benchmark suite; results land in benchmarks/results/."""
    install_project(session, "mooncake-cpu", "dev", "bench")
    session.run("python", "-m", "benchmarks", *session.posargs, env={"HF_HUB_OFFLINE": "1"})


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """The reliability tests at soak sizes (``ENCDISAGG_SOAK=1``): the hostile-client soak,
    the route fuzzers and the transfer contract's state machine, each for minutes; the soak's
    figures land in ``benchmarks/results/soak.json`` (``python -m benchmarks --soak`` runs the
    same beside the benchmarks)."""
    install_project(session, "mooncake-cpu", "dev")
    report = ROOT / "benchmarks" / "results" / "soak.json"
    report.unlink(missing_ok=True)  # each soak test merges its section into a fresh report
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "ENCDISAGG_SOAK": "1"}
    env["ENCDISAGG_SOAK_REPORT"] = str(report)
    args = ["tests/reliability", "-q", "-p", "no:cacheprovider"]
    args += ["--deselect", "tests/reliability/test_bench_runner.py"]
    args += ["--deselect", "tests/reliability/test_gpu_check.py"]
    # Soak-sized tests run for minutes: no per-test timeout or traceback dumps.
    args += ["--timeout", "3600", "-o", "faulthandler_timeout=0"]
    session.run("pytest", *(session.posargs or args), env=env)


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """The GPU check (``benchmarks/gpu_check.py``), for a machine with a GPU: the device-marked
    tests, a real-size tower in bfloat16, transfers out of device memory, the demo and
    ``serve --dp 2`` on the device, in at most 8 minutes; one table, and
    ``benchmarks/results/gpu_check.json``. Installs the CUDA Mooncake wheel (the
    ``mooncake`` extra), so run it in a fresh venv, not one with ``mooncake-cpu``.
    Arguments replace ``--device cuda`` (``nox -s gpu -- --device cpu`` for the CPU run).
    """
    install_project(session, "mooncake", "dev")
    args = session.posargs or ["--device", "cuda"]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    session.run("python", "benchmarks/gpu_check.py", *args, env=env)


@nox.session(python=PYTHON)
def bench_peer(session: nox.Session) -> None:
    """Our request lifecycle against SGLang 0.5.20's, interleaved; see docs/benchmarks.md.

    SGLang's venv (about 3 GB, 5 minutes the first time) is built by the sibling script
    ``../shared/peer/build_venv020.sh`` into ``$ENCDISAGG_PEER_VENV``, else into ``.nox/``.
    """
    build = ROOT.parent / "shared" / "peer" / "build_venv020.sh"
    if not build.is_file():
        session.error(f"no build_venv020.sh in ../shared/peer (looked for {build})")
    peer_venv = os.environ.get("ENCDISAGG_PEER_VENV") or str(ROOT / ".nox" / "sglang-peer-020")
    session.run("bash", str(build), peer_venv, external=True)
    install_project(session, "mooncake-cpu", "bench")
    session.run(
        "python",
        "benchmarks/bench_peer.py",
        *session.posargs,
        env={"ENCDISAGG_PEER_VENV": peer_venv, "HF_HUB_OFFLINE": "1"},
    )


@nox.session(python=PYTHON)
def interop(session: nox.Session) -> None:
    """SGLang 0.5.20's own language-side code against real ``encdisagg serve --wire sglang``
    servers (zmq_to_tokenizer, zmq_to_scheduler, mooncake; asyncio and trio); not part of
    ``tests``. Builds SGLang's venv with ``../shared/peer/build_venv020.sh`` first, into
    ``$ENCDISAGG_PEER_VENV`` or the script's default; see docs/sglang.md.
    """
    build = ROOT.parent / "shared" / "peer" / "build_venv020.sh"
    if not build.is_file():
        session.error(f"no build_venv020.sh in ../shared/peer (looked for {build})")
    peer_venv = os.environ.get("ENCDISAGG_PEER_VENV")
    session.run("bash", str(build), *([peer_venv] if peer_venv else []), external=True)
    # grpc: the servers' --grpc-port, and the versions run.py gives SGLang's gRPC client.
    install_project(session, "mooncake-cpu", "grpc")
    session.run("python", "interop/run.py", *session.posargs, env={"HF_HUB_OFFLINE": "1"})


@nox.session(python=PYTHON)
def interop_vllm(session: nox.Session) -> None:
    """vLLM 0.33's own consumer code (its renderer, scheduler and EC connectors in the
    ``ec_consumer`` role) against real ``encdisagg serve --wire vllm`` servers: the
    ``example`` and ``mooncake`` connectors, asyncio, trio and ``--dp 2``; not part of
    ``tests``. Builds vLLM's venv with ``../shared/peer/build_venv_vllm.sh`` first, into
    ``$ENCDISAGG_VLLM_PEER_VENV`` or the script's default; see docs/vllm.md. Arguments go to
    ``interop/vllm_run.py`` (``-- --self-check``: the consumer harness alone, no servers).
    """
    build = ROOT.parent / "shared" / "peer" / "build_venv_vllm.sh"
    if not build.is_file():
        session.error(f"no build_venv_vllm.sh in ../shared/peer (looked for {build})")
    peer_venv = os.environ.get("ENCDISAGG_VLLM_PEER_VENV")
    session.run("bash", str(build), *([peer_venv] if peer_venv else []), external=True)
    install_project(session, "mooncake-cpu")
    session.run("python", "interop/vllm_run.py", *session.posargs, env={"HF_HUB_OFFLINE": "1"})
