"""smalti-health's config schemas: the ``health`` options (watchdog, straggler, mfu_alarm, gpu_monitor).

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.health.plugin`; checked by smalti-core
after Hydra composes the run and before anything is built.
"""

from __future__ import annotations

from typing import Annotated, Literal

from smalti.core.config.types import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Schema,
    model_validator,
)
from smalti.core.config.validate import field_error


class GpuMonitorSchema(Schema):
    """:class:`smalti.health.gpu_monitor.GpuMonitor`."""

    interval_s: PositiveFloat = 300.0
    call_deadline_s: PositiveFloat = 5.0
    cordon_file: str | None = None


class ThroughputAlarmSchema(Schema):
    """:class:`smalti.health.mfu_alarm.ThroughputAlarm`."""

    min_samples_per_sec: PositiveFloat | None = None
    min_mfu: Probability | None = None
    interval: PositiveInt = 50
    patience: PositiveInt = 3
    action: Literal["warn", "stop"] = "warn"
    run_checks: bool = True
    check_seconds: PositiveFloat = 0.5
    collective_bytes: PositiveInt = 1 << 20
    cordon_file: str | None = None
    peak_flops: PositiveFloat | None = None

    @model_validator(mode="after")
    def _needs_a_floor(self) -> ThroughputAlarmSchema:
        if self.min_samples_per_sec is None and self.min_mfu is None:
            raise field_error("min_mfu", None, "a floor: set min_mfu (0..1) or min_samples_per_sec (or both)")
        return self


class StragglerSchema(Schema):
    """:class:`smalti.health.straggler.StragglerDetector`."""

    interval: PositiveInt = 50
    factor: Annotated[float, Field(gt=1)] = 1.5
    use_cuda_events: bool = True
    warmup_batches: NonNegativeInt | None = None


class WatchdogSchema(Schema):
    """:class:`smalti.health.watchdog.HangWatchdog`."""

    timeout_s: PositiveFloat = 600.0
    first_batch_timeout_s: PositiveFloat | None = None
    report_dir: str | None = None
    poll_s: PositiveFloat = 1.0
    grace_s: NonNegativeFloat = 3.0
    exit_code: Annotated[int, Field(ge=1, le=255)] = 124


def schemas() -> dict[str, type]:
    """What smalti-health's ``smalti_config_schemas`` hook returns."""
    return {
        "smalti.health.gpu_monitor.GpuMonitor": GpuMonitorSchema,
        "smalti.health.mfu_alarm.ThroughputAlarm": ThroughputAlarmSchema,
        "smalti.health.straggler.StragglerDetector": StragglerSchema,
        "smalti.health.watchdog.HangWatchdog": WatchdogSchema,
    }
