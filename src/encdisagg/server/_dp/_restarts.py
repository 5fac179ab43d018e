"""Data parallel: when a worker that died is started again, and when the front gives up.

A synchronous decision on the times of a rank's deaths (DESIGN §2): the first restart comes
quickly, each further one within the window waits twice as long (up to a cap), and once a
rank died ``limit`` times within ``window_s`` it is not restarted again, so a worker that
cannot live (a broken device, a model that crashes on load) does not spin forever.
"""

from __future__ import annotations

from collections import deque
from typing import Final

__all__ = ["RestartPolicy"]

#: Wait before the first restart of a rank within the window.
FIRST_DELAY_S: Final = 0.5
#: Longest wait before a restart.
MAX_DELAY_S: Final = 10.0


class RestartPolicy:
    """Restart decisions for the ranks of one data-parallel front.

    :param limit: restarts allowed per rank within ``window_s`` (0: never restart).
    :param window_s: the sliding window the restarts are counted in.
    """

    def __init__(
        self,
        *,
        limit: int,
        window_s: float,
        first_delay_s: float = FIRST_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
    ) -> None:
        self._limit = limit
        self._window_s = window_s
        self._first_delay_s = first_delay_s
        self._max_delay_s = max_delay_s
        self._restarts: dict[int, deque[float]] = {}

    def on_death(self, rank: int, now: float) -> float | None:
        """Worker ``rank`` died at ``now``: seconds to wait before starting it again, or
        ``None`` if the front gives up on it. Not async; ``now`` from the caller's clock."""
        times = self._restarts.setdefault(rank, deque())
        while times and times[0] <= now - self._window_s:
            times.popleft()
        if len(times) >= self._limit:
            return None
        times.append(now)
        delay: float = self._first_delay_s * 2.0 ** (len(times) - 1)
        return min(delay, self._max_delay_s)

    def restarts(self, rank: int) -> int:
        """Restarts of ``rank`` counted in the current window. Not async."""
        return len(self._restarts.get(rank, ()))
