"""Fixtures of the transfer tests.

Mooncake engines take about a second each to shut down, so the pair every Mooncake test
shares runs for the whole session, on an event loop of its own (a blocking portal): the
engine's methods block and need no loop; only its start and stop are async.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import anyio.to_thread
import pytest
from anyio.from_thread import start_blocking_portal

from encdisagg.transfer import MooncakeEngine

from ._zmq_helpers import TrackingContext


@pytest.fixture(scope="session")
def mooncake_pair() -> Iterator[tuple[MooncakeEngine, MooncakeEngine]]:
    with start_blocking_portal() as portal, ExitStack() as stack:
        first = stack.enter_context(portal.wrap_async_context_manager(MooncakeEngine()))
        second = stack.enter_context(portal.wrap_async_context_manager(MooncakeEngine()))
        yield first, second


@pytest.fixture
def thread_calls(monkeypatch: pytest.MonkeyPatch) -> list[Callable[..., Any]]:
    """Every function run in a worker thread during the test."""
    calls: list[Callable[..., Any]] = []
    original = anyio.to_thread.run_sync

    async def recording(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls.append(func)
        return await original(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", recording)
    return calls


@pytest.fixture
def tracking() -> Iterator[TrackingContext]:
    """A ZMQ context whose sockets record every tracker they hand out."""
    context = TrackingContext()
    context.trackers = []
    yield context
    context.destroy(linger=0)
