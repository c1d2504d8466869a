"""smalti-checkpoint's config schema: the ``checkpoint`` options (:class:`smalti.checkpoint.Checkpointer`).

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.checkpoint.plugin`; checked by smalti-core
after Hydra composes the run and before anything is built. The schema is read off the Checkpointer's
constructor (:func:`smalti.core.config.schema_for`), where each option's type, constraint and default is
written once; only the rule spanning two keys is written here.
"""

from __future__ import annotations

from smalti.core.config import schema_for
from smalti.core.config.types import Schema, model_validator
from smalti.core.config.validate import field_error


class _CheckpointerRules(Schema):
    @model_validator(mode="after")
    def _resume_needs_a_folder(self) -> Schema:
        save_folder = getattr(self, "save_folder", None)
        if getattr(self, "autoresume", False) and not save_folder:
            raise field_error("save_folder", save_folder, "a folder to resume from when autoresume=true")
        return self


def schemas() -> dict[str, type]:
    """What smalti-checkpoint's ``smalti_config_schemas`` hook returns."""
    from smalti.checkpoint.checkpointer import Checkpointer

    return {"smalti.checkpoint.Checkpointer": schema_for(Checkpointer, base=_CheckpointerRules)}
