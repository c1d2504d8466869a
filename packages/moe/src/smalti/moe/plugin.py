"""smalti-moe's entry point for smalti-core: config options and the aux-free bias update callback.

Import-light on purpose (no torch, no triton): every ``smalti`` process loads it.
"""

import pluggy

hookimpl = pluggy.HookimplMarker("smalti")


@hookimpl
def smalti_config_searchpath() -> str:
    return "pkg://smalti.moe.conf"
