"""Fixtures of the vllm-wire tests: Mooncake engines for the stand-in consumer's shards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from anyio.from_thread import start_blocking_portal

from encdisagg.transfer import MooncakeEngine


@pytest.fixture(scope="module")
def shard_engines() -> Iterator[list[MooncakeEngine]]:
    """Two engines, one per TP shard of the stand-in consumer (TCP on loopback)."""
    pytest.importorskip("mooncake.engine")
    with start_blocking_portal() as portal, ExitStack() as stack:
        yield [
            stack.enter_context(portal.wrap_async_context_manager(MooncakeEngine()))
            for _ in range(2)
        ]
