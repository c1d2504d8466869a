"""The one retry policy: its schedule, its budget, what it retries, and that it leaves global RNG state alone."""

import random

import pytest

from smalti.storage import RetryBudgetExceededError, RetryPolicy
from smalti.storage.retry import BUDGET_ENV, DEFAULT_BUDGET_S


class FakeTime:
    """A clock that only moves when the policy sleeps or an attempt 'takes' time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s

    def clock(self) -> float:
        return self.now


def brown_out(clock: FakeTime, until_s: float, attempt_s: float = 0.05):
    """A store call that fails (503-like ConnectionError) until ``until_s`` on the fake clock."""
    calls = []

    def call():
        clock.now += attempt_s
        calls.append(clock.now)
        if clock.now < until_s:
            raise ConnectionError("503 Service Unavailable")
        return "ok"

    return call, calls


def transient(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionError)


def test_default_budget_rides_out_a_60s_brown_out(monkeypatch):
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    for seed in range(500):
        t = FakeTime()
        policy = RetryPolicy(seed=seed, sleep=t.sleep, clock=t.clock)
        assert policy.budget_s == DEFAULT_BUDGET_S
        call, calls = brown_out(t, 60.0)
        assert policy.call(call, transient, "read s3://b/k") == "ok"
        # it came back promptly once the store did: within one maximal wait (plus one attempt) of the end
        assert calls[-1] <= 60.0 + policy.max_delay_s + 0.05


def test_a_short_budget_gives_up_on_the_same_brown_out_naming_what_failed():
    t = FakeTime()
    policy = RetryPolicy(budget_s=10, seed=1, sleep=t.sleep, clock=t.clock)
    call, calls = brown_out(t, 60.0)
    with pytest.raises(RetryBudgetExceededError) as info:
        policy.call(call, transient, "read s3://b/k", "s3://b/k")
    assert t.now <= 10.0 + 0.05
    assert "read s3://b/k" in str(info.value) and BUDGET_ENV in str(info.value)
    assert info.value.attempts == len(calls) and isinstance(info.value.__cause__, ConnectionError)


def test_schedule_is_full_jitter_under_a_doubling_capped_ceiling():
    policy = RetryPolicy(base_s=0.5, max_delay_s=4.0, seed=3)
    delays = [d for d, _ in zip(policy.delays(), range(400))]
    caps = [min(0.5 * 2**n, 4.0) for n in range(400)]
    assert all(0 <= d <= c for d, c in zip(delays, caps))
    # full jitter: waits spread over the whole range, not bunched near the cap
    late = delays[10:]
    assert min(late) < 0.5 and max(late) > 3.5
    assert [d for d, _ in zip(RetryPolicy(base_s=0.5, max_delay_s=4.0, seed=3).delays(), range(400))] == delays


def test_retries_never_touch_the_global_random_state():
    random.seed(1234)
    before = random.getstate()
    t = FakeTime()
    call, calls = brown_out(t, 5.0)
    RetryPolicy(budget_s=30, sleep=t.sleep, clock=t.clock).call(call, transient, "x")
    assert len(calls) > 3
    assert random.getstate() == before


def test_a_permanent_error_is_raised_at_once():
    t = FakeTime()
    attempts = []

    def call():
        attempts.append(1)
        raise PermissionError("403 AccessDenied")

    with pytest.raises(PermissionError):
        RetryPolicy(budget_s=60, sleep=t.sleep, clock=t.clock).call(call, transient, "x")
    assert len(attempts) == 1 and t.sleeps == []


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "7.5")
    assert RetryPolicy().budget_s == 7.5
    assert RetryPolicy(budget_s=3).budget_s == 3  # the argument wins
    monkeypatch.setenv(BUDGET_ENV, "soon")
    with pytest.raises(Exception, match=f"{BUDGET_ENV}='soon' is not a number"):
        RetryPolicy()
