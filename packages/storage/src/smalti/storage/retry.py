"""The one retry policy for all object-store traffic.

Exponential backoff with full jitter (each wait is uniform in ``[0, min(max_delay_s, base_s * 2**n)]``), drawn
from a private :class:`random.Random` so retries never move Python's global ``random`` stream (or torch's),
and a total time budget rather than a count: by default 120 s, enough to ride out a 60 s brown-out of the
store with the longest wait (``max_delay_s``) and a slow first attempt to spare. ``SMALTI_STORAGE_RETRY_BUDGET_S``
overrides the default; a constructor argument overrides both.

Only transient failures are retried (each backend says which: throttling, 5xx, connection resets and
time-outs); anything else is raised at once.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from smalti.storage.errors import RetryBudgetExceededError, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

BUDGET_ENV = "SMALTI_STORAGE_RETRY_BUDGET_S"
DEFAULT_BUDGET_S = 120.0


def _default_budget() -> float:
    raw = os.environ.get(BUDGET_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        raise StorageError(f"{BUDGET_ENV}={raw!r} is not a number of seconds; set it like {BUDGET_ENV}=120") from None
    if value < 0:
        raise StorageError(f"{BUDGET_ENV}={raw!r} is negative; use 0 to disable retries or a number of seconds")
    return value


class RetryPolicy:
    """Backoff with full jitter within a time budget; :meth:`call` runs a function under it.

    Args:
        budget_s: total seconds a call may keep retrying (first attempt included); ``None`` reads
            ``SMALTI_STORAGE_RETRY_BUDGET_S``, else 120. ``0`` means a single attempt.
        base_s: the cap of the first wait; each next cap doubles.
        max_delay_s: the largest cap, so a store that comes back is tried again within this many seconds.
        seed: seeds the private generator (tests); ``None`` seeds it from the OS.
        sleep, clock: injectable for tests that simulate time.
    """

    def __init__(
        self,
        budget_s: float | None = None,
        base_s: float = 0.2,
        max_delay_s: float = 10.0,
        seed: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget_s = _default_budget() if budget_s is None else float(budget_s)
        if base_s <= 0 or max_delay_s < base_s:
            raise StorageError(f"retry policy needs 0 < base_s <= max_delay_s (got {base_s}, {max_delay_s})")
        self.base_s = base_s
        self.max_delay_s = max_delay_s
        self._rng = random.Random(seed)
        self._sleep = sleep
        self._clock = clock

    def __repr__(self) -> str:
        return f"RetryPolicy(budget_s={self.budget_s}, base_s={self.base_s}, max_delay_s={self.max_delay_s})"

    def delays(self) -> Iterator[float]:
        """The waits before each retry, without end: full jitter under a doubling cap."""
        cap = self.base_s
        while True:
            yield self._rng.uniform(0.0, cap)
            cap = min(cap * 2, self.max_delay_s)

    def call(
        self,
        fn: Callable[[], T],
        is_transient: Callable[[BaseException], bool],
        what: str,
        url: str | None = None,
    ) -> T:
        """Run ``fn()``, retrying when it raises an error ``is_transient`` accepts, until the budget is spent.

        Raises the first non-transient error as it is, or :class:`RetryBudgetExceededError` (with the last
        error as ``__cause__``) when the next wait would end past the budget.
        """
        start = self._clock()
        delays = self.delays()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:
                if isinstance(exc, StorageError) or not is_transient(exc):
                    raise
                elapsed = self._clock() - start
                delay = next(delays)
                if elapsed + delay > self.budget_s:
                    raise RetryBudgetExceededError(
                        f"{what} failed for {elapsed:.1f} s ({attempt} attempts), the store did not recover within "
                        f"the retry budget of {self.budget_s:g} s; last error: {_brief(exc)}. "
                        f"Raise {BUDGET_ENV} to wait longer.",
                        url,
                        attempts=attempt,
                        elapsed_s=elapsed,
                    ) from exc
                level = logging.WARNING if attempt == 1 or attempt % 10 == 0 else logging.DEBUG
                log.log(level, "%s failed (attempt %d, %.1f s so far): %s; retrying in %.2f s",
                        what, attempt, elapsed, _brief(exc), delay)
                self._sleep(delay)


def _brief(exc: BaseException) -> str:
    """One line for a log or message: the type and the first line of the text (no traceback)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def is_transient_status(status: int | None) -> bool:
    """HTTP statuses worth retrying: throttling (429), request time-out (408), and 5xx except 501."""
    return status is not None and (status in (408, 429) or (500 <= status < 600 and status != 501))
