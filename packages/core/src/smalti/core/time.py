"""Training time with units: ``Time("2ep")``, ``Time(1000, "ba")``, ``Time("0.1dur")`` and the run's :class:`Timestamp`.

Units: ``ep`` (epochs), ``ba`` (optimizer steps / batches), ``sp`` (samples), ``tok`` (tokens) and ``dur``
(a fraction of the run's ``max_duration``). Durations, intervals, scheduler warmups and checkpoint cadence
all take a :class:`Time` or a string that parses to one.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from smalti.core.errors import TimeError


class TimeUnit(StrEnum):
    """The units a :class:`Time` can carry."""

    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"


_TIME_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ep|ba|sp|tok|dur)\s*$")


@dataclass(frozen=True, slots=True)
class Time:
    """A non-negative amount of training time in one unit. Counting units hold ints; ``dur`` holds a float."""

    value: int | float
    unit: TimeUnit

    def __post_init__(self) -> None:
        unit = TimeUnit(self.unit)
        object.__setattr__(self, "unit", unit)
        if self.value < 0:
            raise TimeError(f"time {self.value}{unit.value} is negative; use a value >= 0")
        if unit is TimeUnit.DURATION:
            object.__setattr__(self, "value", float(self.value))
        else:
            if float(self.value) != int(self.value):
                raise TimeError(f"time {self.value}{unit.value} must be a whole number of {unit.value}")
            object.__setattr__(self, "value", int(self.value))

    @classmethod
    def parse(cls, text: str) -> Time:
        """Parse ``"2ep"``, ``"1000ba"``, ``"2e9tok"``, ``"0.1dur"``; raise :class:`TimeError` naming the text."""
        match = _TIME_RE.match(text)
        if not match:
            raise TimeError(
                f"cannot parse time {text!r}: expected a number followed by one of ep, ba, sp, tok, dur "
                "(e.g. '2ep', '1000ba', '2e9tok', '0.1dur')"
            )
        return cls(float(match.group(1)), TimeUnit(match.group(2)))

    @classmethod
    def from_input(cls, value: Time | str | int, default_unit: TimeUnit | str | None = None) -> Time:
        """Accept a :class:`Time`, a time string, or a bare int in ``default_unit``."""
        if isinstance(value, Time):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, int | float) and default_unit is not None:
            return cls(value, TimeUnit(default_unit))
        raise TimeError(f"cannot read {value!r} as a time: give a string such as '10ba' or '1ep'")

    def __str__(self) -> str:
        return f"{self.value}{self.unit.value}"

    def __repr__(self) -> str:
        return f"Time({str(self)!r})"


@dataclass(slots=True)
class Timestamp:
    """Where the run is: counts since the start and since the epoch began, and wall-clock seconds."""

    epoch: int = 0
    batch: int = 0
    sample: int = 0
    token: int = 0
    batch_in_epoch: int = 0
    sample_in_epoch: int = 0
    token_in_epoch: int = 0
    total_wct: float = 0.0

    def get(self, unit: TimeUnit | str) -> int:
        """The count in ``unit`` (``dur`` is not a count; ask the :class:`~smalti.core.state.State`)."""
        if unit.__class__ is not TimeUnit:  # asked every step with a TimeUnit: no enum lookup then
            unit = TimeUnit(unit)
        if unit is TimeUnit.EPOCH:
            return self.epoch
        if unit is TimeUnit.BATCH:
            return self.batch
        if unit is TimeUnit.SAMPLE:
            return self.sample
        if unit is TimeUnit.TOKEN:
            return self.token
        raise TimeError("a Timestamp counts ep, ba, sp and tok; 'dur' is relative to max_duration")

    def advance_batch(self, samples: int, tokens: int, seconds: float) -> None:
        """Count one finished optimizer step of ``samples`` samples and ``tokens`` tokens."""
        self.batch += 1
        self.batch_in_epoch += 1
        self.sample += samples
        self.sample_in_epoch += samples
        self.token += tokens
        self.token_in_epoch += tokens
        self.total_wct += seconds

    def advance_epoch(self) -> None:
        """Count one finished epoch and reset the in-epoch counters."""
        self.epoch += 1
        self.batch_in_epoch = 0
        self.sample_in_epoch = 0
        self.token_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def copy(self) -> Timestamp:
        return Timestamp(**asdict(self))
