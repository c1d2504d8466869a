"""What every health check returns: a verdict, a message a person can act on, and metrics for the loggers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Verdict(StrEnum):
    """How bad a finding is: ``ok``; ``warn`` (report, keep going); ``fail`` (the node should leave the job)."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


_ORDER = {Verdict.OK: 0, Verdict.WARN: 1, Verdict.FAIL: 2}


def worst(*verdicts: Verdict) -> Verdict:
    """The most severe of ``verdicts`` (``ok`` when there are none)."""
    return max(verdicts, key=_ORDER.__getitem__, default=Verdict.OK)


@dataclass
class CheckResult:
    """One check's outcome: ``name`` (e.g. ``gpu0``, ``all_reduce/1048576``), its verdict, message and metrics.

    Metric keys are flat and prefixed ``health/`` so they sit beside the loss in any logger.
    """

    name: str
    verdict: Verdict
    message: str
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready form (``--json`` output, reports)."""
        return {"name": self.name, "verdict": self.verdict.value, "message": self.message, "metrics": self.metrics}


def merged_metrics(results: list[CheckResult]) -> dict[str, float]:
    """Every result's metrics in one dict, for one ``log_metrics`` call."""
    out: dict[str, float] = {}
    for result in results:
        out.update(result.metrics)
    return out
