"""The circuit breaker's state machine, with a hand-driven clock (no event loop)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from encdisagg.cache import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(threshold: int = 3, cooldown_s: float = 10.0) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(threshold=threshold, cooldown_s=cooldown_s, clock=clock), clock


def test_opens_after_consecutive_failures_only() -> None:
    breaker, _ = make(threshold=3)
    assert breaker.record_failure() is None
    assert breaker.record_failure() is None
    assert breaker.record_success() is None  # resets the count
    assert breaker.record_failure() is None
    assert breaker.record_failure() is None
    assert breaker.record_failure() is BreakerState.OPEN
    assert breaker.allow() == (False, None)
    assert breaker.opens == 1


def test_cooldown_then_a_single_probe() -> None:
    breaker, clock = make(threshold=1, cooldown_s=10)
    breaker.record_failure()
    clock.now += 9.9
    assert breaker.allow() == (False, None)
    clock.now += 0.1
    assert breaker.allow() == (True, BreakerState.HALF_OPEN)
    assert breaker.allow() == (False, None)  # one probe at a time
    assert breaker.record_success() is BreakerState.CLOSED
    assert breaker.allow() == (True, None)


def test_a_failed_probe_reopens_for_a_fresh_cooldown() -> None:
    breaker, clock = make(threshold=2, cooldown_s=5)
    breaker.record_failure()
    breaker.record_failure()
    clock.now += 5
    assert breaker.allow() == (True, BreakerState.HALF_OPEN)
    clock.now += 3
    assert breaker.record_failure() is BreakerState.OPEN
    clock.now += 4.9
    assert breaker.allow() == (False, None)
    clock.now += 0.1
    assert breaker.allow()[0]
    assert breaker.opens == 2


def test_late_failures_do_not_extend_the_cooldown() -> None:
    breaker, clock = make(threshold=1, cooldown_s=5)
    breaker.record_failure()
    clock.now += 4
    assert breaker.record_failure() is None
    clock.now += 1
    assert breaker.allow() == (True, BreakerState.HALF_OPEN)


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="threshold"):
        CircuitBreaker(threshold=0, cooldown_s=1, clock=Clock())
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreaker(threshold=1, cooldown_s=0, clock=Clock())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["ok", "fail", "allow", "tick"]), max_size=60))
def test_invariants_hold_for_any_sequence(steps: list[str]) -> None:
    threshold, cooldown = 3, 10.0
    breaker, clock = make(threshold=threshold, cooldown_s=cooldown)
    streak = 0
    opened_at: float | None = None
    for step in steps:
        if step == "ok":
            breaker.record_success()
            streak = 0
            assert breaker.state is BreakerState.CLOSED
        elif step == "fail":
            before = breaker.state
            changed = breaker.record_failure()
            streak = streak + 1 if before is BreakerState.CLOSED else 0
            if changed is BreakerState.OPEN:
                opened_at = clock.now
                streak = 0
            elif before is BreakerState.CLOSED:
                assert streak < threshold
        elif step == "tick":
            clock.now += 4.0
        else:
            allowed, _ = breaker.allow()
            if breaker.state is BreakerState.OPEN:
                assert not allowed
                assert opened_at is not None
                assert clock.now < opened_at + cooldown
        if breaker.state is BreakerState.CLOSED:
            assert breaker.allow() == (True, None)
