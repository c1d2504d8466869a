"""smalti-health's entry-point module: discovery hooks only, import-light (no torch at import)."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("smalti")


@hookimpl
def smalti_config_searchpath() -> str:
    """Add the ``health`` config group's options: watchdog, straggler, mfu_alarm, gpu_monitor."""
    return "pkg://smalti.health.conf"


@hookimpl
def smalti_config_schemas() -> dict[str, type]:
    """The schemas of the ``health`` options, checked before anything is built."""
    from smalti.health.config_schema import schemas

    return schemas()
