"""Qwen3-MoE: Qwen3's attention (per-head QK-norm, its own ``head_dim``) with a mixture of SwiGLU experts of
width ``moe_intermediate_size`` in every block, on smalti-moe's dropless layer.

Its router takes the softmax over every expert and keeps the top ``num_experts_per_tok``, renormalised only when
``norm_topk_prob``; its auxiliary loss is Mixtral's (see :mod:`smalti.llm.hf.families.mixtral`). Dense layers
between the sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused, naming the field.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.hf.families.experts import expert_parts, moe_fields, moe_options, moe_problems
from smalti.llm.hf.families.qwen3 import Qwen3
from smalti.llm.hf.family import WeightParts


def refuse_dense_layers(cfg: dict[str, Any], path: Path) -> None:
    """Qwen-MoE's dense layers among the sparse ones are not reproduced: refuse them naming the field."""
    if cfg.get("mlp_only_layers"):
        raise ConversionError(f"{path}: mlp_only_layers={cfg['mlp_only_layers']} makes those layers dense, which "
                              "smalti does not reproduce (every block is an MoE); it must be []")
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise ConversionError(f"{path}: decoder_sparse_step={cfg['decoder_sparse_step']} makes some layers dense, "
                              "which smalti does not reproduce; it must be 1")


def qwen_expert_parts(c: dict[str, Any], layer: int, names: Collection[str] | None) -> WeightParts:
    """``mlp.gate`` and ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (or fused) of layer ``layer``."""
    mlp = f"model.layers.{layer}.mlp."
    return expert_parts(str(layer), c["moe"]["num_experts"], c["ffn_hidden_size"], names, router=mlp + "gate.weight",
                        per_expert=tuple(mlp + f"experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")),
                        fused=mlp + "experts.")


class Qwen3Moe(Qwen3):
    """``Qwen3MoeForCausalLM``."""

    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    description = "Qwen3-MoE"
    ffn = "moe"

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """See :meth:`Qwen3.llm_kwargs`: an MoE FFN of ``moe_intermediate_size`` per expert."""
        refuse_dense_layers(cfg, path)
        out = super().llm_kwargs(cfg, path)
        experts = cfg.get("num_experts") or cfg["num_local_experts"]
        moe = moe_options(cfg, path, experts, cfg["num_experts_per_tok"], bool(cfg.get("norm_topk_prob", False)))
        return {**out, "ffn_hidden_size": cfg["moe_intermediate_size"], "ffn_type": "moe", "moe": moe}

    def shape_problems(self, c: dict[str, Any]) -> list[str]:
        """See :meth:`Qwen3.shape_problems`."""
        return super().shape_problems(c) + moe_problems(c)

    def hf_extra(self, c: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`Qwen3.hf_extra`."""
        moe = c["moe"]
        return {**super().hf_extra(c), "num_experts": moe["num_experts"], "moe_intermediate_size": c["ffn_hidden_size"],
                "norm_topk_prob": moe.get("normalize_expert_weights") is not None, "mlp_only_layers": [],
                "decoder_sparse_step": 1, **moe_fields(c)}

    def ffn_parts(self, c: dict[str, Any], layer: int, ffn_bias: bool, names: Collection[str] | None) -> WeightParts:
        """See :meth:`Qwen3.ffn_parts`."""
        return qwen_expert_parts(c, layer, names)


FAMILY = Qwen3Moe()
