"""smalti-moe's entry point for smalti-core: where its config options live.

Import-light on purpose (no torch, no triton): every ``smalti`` process loads it. The aux-free bias
update is a callback option (``callbacks=[moe_bias_update]``, :class:`smalti.moe.balancing.AuxFreeBiasUpdate`)
built by Hydra only when chosen.
"""

import pluggy

hookimpl = pluggy.HookimplMarker("smalti")


@hookimpl
def smalti_config_searchpath() -> str:
    """The ``pkg://`` directory of smalti-moe's config group options."""
    return "pkg://smalti.moe.conf"


@hookimpl
def smalti_config_schemas() -> dict:
    """The schemas of ``MoE``'s and the bias-update callback's options, checked by smalti-core before building."""
    from smalti.moe.config_schema import schemas

    return schemas()
