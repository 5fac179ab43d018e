"""A circuit breaker for the global tier: synchronous, never awaits, clock injected."""

from __future__ import annotations

import enum
from collections.abc import Callable

from .._numbers import real, whole

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.Enum):
    """Where a :class:`CircuitBreaker` stands."""

    #: The global tier is used.
    CLOSED = "closed"
    #: Skipped until the cool-down has passed.
    OPEN = "open"
    #: Cool-down over: one call probes the store; its outcome closes or reopens the breaker.
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Opens after ``threshold`` consecutive failures; probes again ``cooldown_s`` later.

    Every method is synchronous and reads time only through ``clock``, so the state machine
    runs (and is tested) without an event loop. Outcomes of calls that started before a
    transition still count: a late success closes the breaker, a late failure while
    half-open reopens it. Each method returns the new state when it changed the state,
    else ``None``, so callers can report transitions.

    :param threshold: consecutive failures that open the breaker (at least 1).
    :param cooldown_s: how long it stays open before a probe is allowed.
    :param clock: the current time in seconds (e.g. ``anyio.current_time``).
    """

    def __init__(self, *, threshold: int, cooldown_s: float, clock: Callable[[], float]) -> None:
        whole("threshold", threshold, least=1)
        real("cooldown_s", cooldown_s, above=0, finite=False)
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        # Consecutive failures while closed; reset by any success.
        self._failures = 0
        # When the open breaker lets a probe through (meaningful while OPEN).
        self._retry_at = 0.0
        # Whether the half-open probe has been handed out and not yet answered.
        self._probing = False
        #: How many times the breaker opened (from closed or from half-open).
        self.opens = 0

    @property
    def state(self) -> BreakerState:
        """The state as of the last call; an open breaker turns half-open in :meth:`allow`."""
        return self._state

    @property
    def closed(self) -> bool:
        return self._state is BreakerState.CLOSED

    def allow(self) -> tuple[bool, BreakerState | None]:
        """Whether a call may use the store now, and the new state if this changed it.

        Closed: always. Open: no, until the cool-down passed; then the breaker turns
        half-open and this call is the probe. Half-open: no while the probe is unanswered.
        """
        if self._state is BreakerState.CLOSED:
            return True, None
        if self._state is BreakerState.OPEN:
            if self._clock() < self._retry_at:
                return False, None
            self._state = BreakerState.HALF_OPEN
            self._probing = True
            return True, BreakerState.HALF_OPEN
        if self._probing:
            return False, None
        self._probing = True
        return True, None

    def record_success(self) -> BreakerState | None:
        """A store call worked: close the breaker."""
        self._failures = 0
        self._probing = False
        if self._state is BreakerState.CLOSED:
            return None
        self._state = BreakerState.CLOSED
        return BreakerState.CLOSED

    def record_failure(self) -> BreakerState | None:
        """A store call failed: count it; open the breaker at the threshold or on a failed probe."""
        if self._state is BreakerState.OPEN:
            # A call that started before the breaker opened; the cool-down stands.
            return None
        if self._state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures < self.threshold:
                return None
        self._open()
        return BreakerState.OPEN

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._failures = 0
        self._probing = False
        self._retry_at = self._clock() + self.cooldown_s
        self.opens += 1
