"""smalti-streaming's entry point for smalti-core: its config options (``data=streaming``). Import-light."""

import pluggy

hookimpl = pluggy.HookimplMarker("smalti")


@hookimpl
def smalti_config_searchpath() -> str:
    return "pkg://smalti.streaming.conf"
