"""The running event loop's clock and checkpoint, each looked up once and handed on as a
plain function (the clock to inject into synchronous code, the checkpoint to await on hot
paths)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

import sniffio

__all__ = ["loop_checkpoint", "loop_clock"]


def loop_clock() -> Callable[[], float]:
    """The running loop's own clock (what ``anyio.current_time`` reads), without AnyIO's
    per-call backend lookup: ``trio.current_time`` on Trio (a ``MockClock`` included), the
    loop's ``time`` on asyncio. Call it on the loop; the function returned is valid in that
    loop only."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.current_time

    return asyncio.get_running_loop().time


def loop_checkpoint() -> Callable[[], Awaitable[None]]:
    """What ``anyio.lowlevel.checkpoint`` awaits on the running backend, without its
    per-call backend lookup: ``trio.lowlevel.checkpoint`` on Trio, ``asyncio.sleep(0)`` on
    asyncio (both a cancel point and a schedule point, as AnyIO's own). Call it on the loop;
    the function returned is valid on that backend only."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.checkpoint
    return partial(asyncio.sleep, 0)
