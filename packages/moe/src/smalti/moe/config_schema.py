"""smalti-moe's config schemas: the options of :class:`smalti.moe.MoE` and of the aux-free bias update callback.

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.moe.plugin`, which only smalti-core calls:
the schemas are pydantic models (pydantic comes with smalti-core); smalti-moe's layers do not need it.
smalti-llm checks ``model.moe`` with :class:`MoESchema` (MegaBlocks-style names are accepted as aliases).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from smalti.moe.ops import BACKENDS
from smalti.moe.reference import ACTIVATIONS

Positive = Annotated[int, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]


def _alias(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class MoESchema(BaseModel):
    """:class:`smalti.moe.MoE`'s options as given in an LLM's ``model.moe``: the sizes come from the model, and an
    unset ``activation`` is the model's own."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    num_experts: Positive = Field(8, validation_alias=_alias("num_experts", "moe_num_experts"))
    top_k: Positive = Field(2, validation_alias=_alias("top_k", "moe_top_k"))
    mlp_type: Literal["mlp", "glu"] = "mlp"
    activation: Literal[tuple(ACTIVATIONS)] | None = Field(  # type: ignore[valid-type]
        None, validation_alias=_alias("activation", "activation_fn"))
    capacity_factor: NonNegative | None = Field(None, validation_alias=_alias("capacity_factor", "moe_capacity_factor"))
    num_shared_experts: Annotated[int, Field(ge=0)] = 0
    shared_expert_size: Annotated[int, Field(ge=0)] = 0
    shared_expert_gate: bool = False
    router_jitter: Annotated[float, Field(ge=0, lt=1)] = Field(0.0, validation_alias=_alias("router_jitter",
                                                                                               "moe_jitter_eps"))
    jitter_experts: bool = False
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    load_balancing: Literal["aux_loss", "aux_free", "none"] = "aux_loss"
    lbl_weight: NonNegative = Field(0.1, validation_alias=_alias("lbl_weight", "loss_weight", "moe_loss_weight"))
    zloss_weight: NonNegative = Field(0.0, validation_alias=_alias("zloss_weight", "moe_zloss_weight"))
    lbl_scope: Literal["layer", "model"] = "layer"
    normalize_expert_weights: Annotated[float, Field(gt=0)] | None = Field(
        None, validation_alias=_alias("normalize_expert_weights", "moe_normalize_expert_weights"))
    backend: Literal[BACKENDS] = "torch"  # type: ignore[valid-type]

    @field_validator("top_k")
    @classmethod
    def _top_k_within_experts(cls, top_k: int, info: ValidationInfo) -> int:
        num_experts = info.data.get("num_experts")
        if isinstance(num_experts, int) and top_k > num_experts:
            raise ValueError(f"at most num_experts={num_experts}")
        return top_k


class MoELayerSchema(MoESchema):
    """:class:`smalti.moe.MoE`'s options when it is built directly (``_target_: smalti.moe.MoE``)."""

    activation: Literal[tuple(ACTIVATIONS)] = Field(  # type: ignore[valid-type]
        "gelu", validation_alias=_alias("activation", "activation_fn"))


class AuxFreeBiasUpdateSchema(BaseModel):
    """:class:`smalti.moe.balancing.AuxFreeBiasUpdate` (``callbacks=[moe_bias_update]``)."""

    model_config = ConfigDict(extra="allow")

    coeff: Annotated[float, Field(gt=0)] = 1e-3


def schemas() -> dict[str, type]:
    """What smalti-moe's ``smalti_config_schemas`` hook returns."""
    return {"smalti.moe.MoE": MoELayerSchema, "smalti.moe.balancing.AuxFreeBiasUpdate": AuxFreeBiasUpdateSchema}
