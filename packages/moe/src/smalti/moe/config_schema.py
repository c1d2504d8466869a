"""smalti-moe's config schemas: the options of :class:`smalti.moe.MoE` and of the aux-free bias update callback.

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.moe.plugin`, which only smalti-core calls, so this
module may use smalti-core's :func:`~smalti.core.config.schema_for` (the ``config`` extra); smalti-moe's layers
stay free of pydantic and of smalti-core. Each schema is read off its component's signature: keys and defaults
come from there; the value ranges a plain annotation cannot state are the ``checks`` below (one per argument).
smalti-llm checks ``model.moe`` with :data:`MoESchema` (MegaBlocks-style names are accepted as aliases).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices

from smalti.core.config import schema_for
from smalti.core.config.types import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ProperFraction,
    Schema,
    field_error,
    model_validator,
)
from smalti.moe.balancing import AuxFreeBiasUpdate
from smalti.moe.layer import MoE
from smalti.moe.ops import BACKENDS
from smalti.moe.reference import ACTIVATIONS

_Activation = Literal[tuple(ACTIVATIONS)]  # type: ignore[valid-type]

#: What :class:`~smalti.moe.MoE`'s plain ``int``/``float``/``str`` annotations cannot say.
MOE_CHECKS = {
    "hidden_size": PositiveInt,
    "ffn_hidden_size": PositiveInt,
    "num_experts": PositiveInt,
    "top_k": PositiveInt,
    "mlp_type": Literal["mlp", "glu"],
    "activation": _Activation,
    "capacity_factor": NonNegativeFloat | None,
    "num_shared_experts": NonNegativeInt,
    "shared_expert_size": NonNegativeInt,
    "router_jitter": ProperFraction,
    "score_func": Literal["softmax", "sigmoid"],
    "load_balancing": Literal["aux_loss", "aux_free", "none"],
    "lbl_weight": NonNegativeFloat,
    "zloss_weight": NonNegativeFloat,
    "lbl_scope": Literal["layer", "model"],
    "normalize_expert_weights": PositiveFloat | None,
    "backend": Literal[BACKENDS],  # type: ignore[valid-type]
    "num_layers": PositiveInt,
}
#: MegaBlocks' names for the same options (as :func:`smalti.llm.model.moe_adapter.moe_kwargs` maps them).
MOE_ALIASES = {
    "num_experts": ("moe_num_experts",),
    "top_k": ("moe_top_k",),
    "activation": ("activation_fn",),
    "capacity_factor": ("moe_capacity_factor",),
    "router_jitter": ("moe_jitter_eps",),
    "lbl_weight": ("loss_weight", "moe_loss_weight"),
    "zloss_weight": ("moe_zloss_weight",),
    "normalize_expert_weights": ("moe_normalize_expert_weights",),
}


class _MoERules(Schema):
    @model_validator(mode="after")
    def _top_k_within_experts(self) -> Schema:
        num_experts, top_k = getattr(self, "num_experts", None), getattr(self, "top_k", None)
        if isinstance(num_experts, int) and isinstance(top_k, int) and top_k > num_experts:
            raise field_error("top_k", top_k, f"at most num_experts={num_experts}")
        return self


class _MoEInAModel(_MoERules):
    """In an LLM's ``model.moe`` the sizes come from the model, and an unset ``activation`` is the model's own."""

    activation: _Activation | None = Field(None, validation_alias=AliasChoices("activation", "activation_fn"))


#: :class:`smalti.moe.MoE`'s options when it is built directly (``_target_: smalti.moe.MoE``).
MoELayerSchema = schema_for(MoE, checks=MOE_CHECKS, aliases=MOE_ALIASES, base=_MoERules, name="MoELayerSchema")
#: :class:`smalti.moe.MoE`'s options as given in an LLM's ``model.moe``.
MoESchema = schema_for(MoE, checks={k: v for k, v in MOE_CHECKS.items() if k != "activation"},
                       aliases={k: v for k, v in MOE_ALIASES.items() if k != "activation"},
                       exclude=("hidden_size", "ffn_hidden_size", "activation"), base=_MoEInAModel, name="MoESchema")
#: :class:`smalti.moe.balancing.AuxFreeBiasUpdate` (``callbacks=[moe_bias_update]``).
AuxFreeBiasUpdateSchema = schema_for(AuxFreeBiasUpdate, checks={"coeff": PositiveFloat})


def schemas() -> dict[str, type]:
    """What smalti-moe's ``smalti_config_schemas`` hook returns."""
    return {"smalti.moe.MoE": MoELayerSchema, "smalti.moe.balancing.AuxFreeBiasUpdate": AuxFreeBiasUpdateSchema}
