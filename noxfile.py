"""Development sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s demo``, ``nox -s bench``.

Every install goes through ``constraints.txt``: an unpinned torch can resolve to a multi-GB
CUDA build, so torch is installed first, pinned, and every later install is constrained to it.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint"]

PYTHON = "3.11"
CONSTRAINTS = ("-c", "constraints.txt")


def install_project(session: nox.Session, *extras: str) -> None:
    session.install(*CONSTRAINTS, "torch")
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install(*CONSTRAINTS, "-e", spec)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite (asyncio and Trio) with the CPU Mooncake engine."""
    install_project(session, "mooncake-cpu", "dev")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    session.run("pytest", *(session.posargs or ["-q"]), env=env)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and mypy (strict on src/)."""
    install_project(session, "dev")
    session.run("ruff", "check", "src", "tests", "examples", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "examples", "benchmarks", "noxfile.py")
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
