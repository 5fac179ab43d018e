"""Waiting on a registry view without sleeping: each change wakes the waiter."""

from __future__ import annotations

from collections.abc import Callable

import anyio

from encdisagg.registry import RegistryView

#: Bound on a wait for etcd to show a change (a lease of 2 s expires within about 3 s).
WAIT_S = 15.0


async def wait_for(view: RegistryView, condition: Callable[[], bool], what: str) -> None:
    """Wait until ``condition()`` holds, re-checking at every change of ``view``."""
    try:
        with anyio.fail_after(WAIT_S):
            while not condition():
                await view.wait_changed()
    except TimeoutError:
        raise AssertionError(f"gave up waiting for {what}; view: {view.records}") from None
