"""smalti-llm's entry-point module: adds the package's config options (models, data, experiments) to Hydra.

Import-light on purpose: every smalti process loads it, so it imports neither torch nor smalti.core.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("smalti")


@hookimpl
def smalti_config_searchpath() -> str:
    """Where smalti-llm's config groups live: model, data, callbacks and experiment options (and, for them, the
    ``${smalti_hf_max_seq_len:<folder>}`` resolver of ``model=hf``)."""
    from smalti.llm.hf.context_length import register_resolver

    register_resolver()
    return "pkg://smalti.llm.conf"


@hookimpl
def smalti_plan_model(model: Any, setup: Any) -> Any:
    """``smalti plan``: activation bytes and FLOPs of an :class:`smalti.llm.LLM` micro batch (:mod:`smalti.llm.plan`)."""
    from smalti.llm.plan import plan_model

    return plan_model(model, setup)


@hookimpl
def smalti_config_schemas() -> dict:
    """The schemas of smalti-llm's models, datasets, parallelism and callbacks, checked before building."""
    from smalti.llm.config_schema import schemas

    return schemas()
