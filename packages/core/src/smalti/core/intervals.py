"""When an interval given as :class:`~smalti.core.time.Time` fires: evaluation and checkpoint cadence."""

from __future__ import annotations

from typing import TYPE_CHECKING

from smalti.core.errors import ConfigError
from smalti.core.time import Time, TimeUnit

if TYPE_CHECKING:
    from smalti.core.state import State


def interval_fires(interval: Time | str, state: State, event: str) -> bool:
    """Whether ``interval`` fires at ``event`` (``batch_end`` or ``epoch_end``) given ``state``'s timestamp.

    ``ep`` intervals fire at epoch end; the others at batch end, when the count crossed a multiple of the
    interval during the batch that just ended (so ``"1000tok"`` fires even when batches hold 384 tokens).
    """
    interval = Time.from_input(interval)
    ts = state.timestamp
    if interval.unit is TimeUnit.EPOCH:
        return event == "epoch_end" and interval.value > 0 and ts.epoch % int(interval.value) == 0
    if event != "batch_end" or interval.value <= 0:
        return False
    if interval.unit is TimeUnit.BATCH:
        return ts.batch % int(interval.value) == 0
    if interval.unit is TimeUnit.DURATION:
        now = state.elapsed_fraction()
        total = state.to_batches(state.max_duration)
        before = (ts.batch - 1) / total if total else 0.0
        return int(now / interval.value + 1e-9) > int(before / interval.value + 1e-9)
    count = ts.get(interval.unit)
    step = state.batch_num_samples if interval.unit is TimeUnit.SAMPLE else state.batch_num_tokens
    return count // int(interval.value) > (count - step) // int(interval.value)


def batch_count(value: Time | str | int, key: str, example: str = "10ba") -> int:
    """``value`` (``"10ba"`` or a bare int) as a number of batches >= 1; a ``ConfigError`` naming ``key`` otherwise.

    For the cadences of monitors and algorithms that only make sense in optimizer steps (``key`` is the full
    config key, e.g. ``"callbacks.optimizer_monitor.interval"``).
    """
    try:
        parsed = Time.from_input(value, "ba")
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's value
        raise ConfigError(f"{key}={value!r}: {exc}") from None
    if parsed.unit is not TimeUnit.BATCH or parsed.value < 1:
        raise ConfigError(f"{key}={value!r} must be a number of batches >= 1, e.g. {example}")
    return int(parsed.value)
