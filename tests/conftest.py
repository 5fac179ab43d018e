"""Test-wide fixtures.

Every ``@pytest.mark.anyio`` test runs on asyncio and on Trio. A test also marked
``@pytest.mark.virtual_time`` runs on Trio alone, with a ``MockClock`` that jumps ahead
whenever every task is blocked, so multi-minute deadlines pass in microseconds (AnyIO has
no mock clock for asyncio).
"""

from __future__ import annotations

import os

import pytest
import trio.testing
from hypothesis import settings

# In CI, property tests replay the same examples every run (a landing must not depend on a
# lucky draw); locally they explore afresh, and print the blob to reproduce a failure.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# `encdisagg serve` processes the tests stop close at once; the drain tests set their delay.
os.environ.setdefault("ENCDISAGG_DRAIN_DELAY", "0")

BACKENDS = ("asyncio", "trio")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "virtual_time: run on Trio alone, with an autojumping MockClock"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "anyio_backend" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("virtual_time"):
        metafunc.parametrize("anyio_backend", ["trio-virtual-time"], indirect=True)
    elif not any(
        "anyio_backend" in getattr(mark, "args", ())[:1]
        for mark in metafunc.definition.iter_markers("parametrize")
    ):
        metafunc.parametrize("anyio_backend", BACKENDS, indirect=True)


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> object:
    name = getattr(request, "param", "asyncio")
    if name == "trio-virtual-time":
        # Jump only after 50 ms of real idleness: work in worker threads (which the clock
        # cannot see) then finishes before virtual deadlines pass.
        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0.05)})
    return name
