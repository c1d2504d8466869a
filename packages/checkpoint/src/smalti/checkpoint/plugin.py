"""smalti-checkpoint's entry-point module: discovery hooks only, import-light (no torch at import)."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("smalti")


@hookimpl
def smalti_config_searchpath() -> str:
    """Add ``checkpoint=dcp`` and ``checkpoint=s3`` to smalti-train's config groups."""
    return "pkg://smalti.checkpoint.conf"


@hookimpl
def smalti_config_schemas() -> dict[str, type]:
    """The schema of the ``checkpoint`` options, checked before anything is built."""
    from smalti.checkpoint.config_schema import schemas

    return schemas()
