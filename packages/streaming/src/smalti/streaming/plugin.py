"""smalti-streaming's entry point for smalti-core: its config options (``data=streaming``). Import-light."""

import pluggy

hookimpl = pluggy.HookimplMarker("smalti")


@hookimpl
def smalti_config_searchpath() -> str:
    return "pkg://smalti.streaming.conf"


@hookimpl
def smalti_config_schemas() -> dict:
    """The schema of ``StreamingDataset``'s options (``data=streaming``), checked by smalti-core before building."""
    from smalti.streaming.config_schema import schemas

    return schemas()
