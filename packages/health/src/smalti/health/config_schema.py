"""smalti-health's config schemas: the ``health`` options (watchdog, straggler, mfu_alarm, gpu_monitor).

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.health.plugin`; checked by smalti-core
after Hydra composes the run and before anything is built. Each schema is read off its component's
constructor (:func:`smalti.core.config.schema_for`): types, constraints and defaults are written there once.
"""

from __future__ import annotations

from smalti.core.config import schema_for
from smalti.core.config.types import Schema, model_validator
from smalti.core.config.validate import field_error


class _ThroughputAlarmRules(Schema):
    @model_validator(mode="after")
    def _needs_a_floor(self) -> Schema:
        if getattr(self, "min_samples_per_sec", None) is None and getattr(self, "min_mfu", None) is None:
            raise field_error("min_mfu", None, "a floor: set min_mfu (0..1) or min_samples_per_sec (or both)")
        return self


def schemas() -> dict[str, type]:
    """What smalti-health's ``smalti_config_schemas`` hook returns."""
    from smalti.health.gpu_monitor import GpuMonitor
    from smalti.health.mfu_alarm import ThroughputAlarm
    from smalti.health.straggler import StragglerDetector
    from smalti.health.watchdog import HangWatchdog

    return {
        "smalti.health.gpu_monitor.GpuMonitor": schema_for(GpuMonitor),
        "smalti.health.mfu_alarm.ThroughputAlarm": schema_for(ThroughputAlarm, base=_ThroughputAlarmRules),
        "smalti.health.straggler.StragglerDetector": schema_for(StragglerDetector),
        "smalti.health.watchdog.HangWatchdog": schema_for(HangWatchdog),
    }
