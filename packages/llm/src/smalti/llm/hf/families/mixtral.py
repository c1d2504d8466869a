"""Mixtral: Mistral's attention with a mixture of SwiGLU experts in every block, on smalti-moe's dropless layer.

Its router takes the softmax over every expert, keeps the top ``num_experts_per_tok`` and renormalises them
to sum one; ``router_jitter_noise`` multiplies the block's input (for the router and the experts) in training
only; its auxiliary loss is ``load_balancing_loss_func`` over every layer's router logits, times
``router_aux_loss_coef``, added to the loss when ``output_router_logits``.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from smalti.llm.hf.families.experts import expert_parts, moe_fields, moe_options, moe_problems
from smalti.llm.hf.families.llama import LlamaLike
from smalti.llm.hf.family import WeightParts


class Mixtral(LlamaLike):
    """``MixtralForCausalLM``."""

    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    description = "Mixtral (MoE)"
    ffn = "moe"

    def sliding_window(self, cfg: dict[str, Any], path: Path) -> int | None:
        """See :meth:`LlamaLike.sliding_window`: like Mistral's, on every layer."""
        return cfg.get("sliding_window")

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """See :meth:`LlamaLike.llm_kwargs`: Mistral's arguments with an MoE FFN."""
        out = super().llm_kwargs(cfg, path)
        moe = moe_options(cfg, path, cfg["num_local_experts"], cfg["num_experts_per_tok"], True,
                          cfg.get("router_jitter_noise") or 0.0)
        return {**out, "ffn_type": "moe", "moe": moe}

    def shape_problems(self, c: dict[str, Any]) -> list[str]:
        """See :meth:`LlamaLike.shape_problems`."""
        out = moe_problems(c, norm_topk_prob=True)
        if c.get("attn_bias") or c.get("qkv_bias") or c.get("ffn_bias"):
            out.append("biases (Mixtral has none)")
        return out

    def hf_extra(self, c: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`LlamaLike.hf_extra`."""
        return {"sliding_window": c.get("sliding_window"), "num_local_experts": c["moe"]["num_experts"],
                "router_jitter_noise": c["moe"].get("router_jitter", 0.0), **moe_fields(c)}

    def ffn_parts(self, c: dict[str, Any], layer: int, ffn_bias: bool, names: Collection[str] | None) -> WeightParts:
        """See :meth:`LlamaLike.ffn_parts`: ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down) or fused."""
        legacy = f"model.layers.{layer}.block_sparse_moe."
        return expert_parts(
            str(layer), c["moe"]["num_experts"], c["ffn_hidden_size"], names, router=legacy + "gate.weight",
            per_expert=(legacy + "experts.{e}.w1.weight", legacy + "experts.{e}.w3.weight",
                        legacy + "experts.{e}.w2.weight"),
            fused=f"model.layers.{layer}.mlp.experts.", fused_router=f"model.layers.{layer}.mlp.gate.weight",
        )


FAMILY = Mixtral()
