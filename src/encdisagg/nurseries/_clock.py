"""The running event loop's clock, as a plain function to inject into synchronous code."""

from __future__ import annotations

from collections.abc import Callable

import sniffio

__all__ = ["loop_clock"]


def loop_clock() -> Callable[[], float]:
    """The running loop's own clock (what ``anyio.current_time`` reads), without AnyIO's
    per-call backend lookup: ``trio.current_time`` on Trio (a ``MockClock`` included), the
    loop's ``time`` on asyncio. Call it on the loop; the function returned is valid in that
    loop only."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.current_time
    import asyncio

    return asyncio.get_running_loop().time
