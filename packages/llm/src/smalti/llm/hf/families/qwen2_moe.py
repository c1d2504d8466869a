"""Qwen2-MoE: Qwen2's attention (q/k/v biases by ``qkv_bias``, its window rule) with a mixture of SwiGLU
experts of width ``moe_intermediate_size`` plus one shared SwiGLU expert of ``shared_expert_intermediate_size``
scaled per token by ``sigmoid(shared_expert_gate(x))``, on smalti-moe's dropless layer.

Its router and auxiliary loss are Qwen3-MoE's; dense layers among the sparse ones are refused the same way.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from smalti.llm.hf.families.experts import moe_fields, moe_options, moe_problems
from smalti.llm.hf.families.qwen2 import Qwen2
from smalti.llm.hf.families.qwen3_moe import qwen_expert_parts, refuse_dense_layers
from smalti.llm.hf.family import Part, WeightParts


class Qwen2Moe(Qwen2):
    """``Qwen2MoeForCausalLM``."""

    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    description = "Qwen2-MoE / Qwen1.5-MoE"
    ffn = "moe"

    def biases(self, cfg: dict[str, Any]) -> dict[str, bool]:
        """See :meth:`Qwen2.biases`: q/k/v by ``qkv_bias`` (default on)."""
        return {"attn_bias": False, "qkv_bias": bool(cfg.get("qkv_bias", True)), "ffn_bias": False}

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """See :meth:`Qwen2.llm_kwargs`: routed experts of ``moe_intermediate_size`` and the gated shared one."""
        refuse_dense_layers(cfg, path)
        out = super().llm_kwargs(cfg, path)
        experts = cfg.get("num_experts") or cfg["num_local_experts"]
        moe = moe_options(cfg, path, experts, cfg["num_experts_per_tok"], bool(cfg.get("norm_topk_prob", False)))
        moe.update(shared_expert_size=int(cfg["shared_expert_intermediate_size"]), shared_expert_gate=True)
        return {**out, "ffn_hidden_size": cfg["moe_intermediate_size"], "ffn_type": "moe", "moe": moe}

    def shape_problems(self, c: dict[str, Any]) -> list[str]:
        """See :meth:`Qwen2.shape_problems`: q/k/v biases or none, and a gated shared expert."""
        moe = c.get("moe") or {}
        out = moe_problems({**c, "moe": {**moe, "shared_expert_size": 0}})
        if not moe.get("shared_expert_size") or not moe.get("shared_expert_gate"):
            out.append("no gated shared expert (moe.shared_expert_size, moe.shared_expert_gate)")
        if c.get("attn_bias") or c.get("ffn_bias"):
            out.append("biases other than on q/k/v (Qwen2-MoE has those only)")
        return out

    def hf_extra(self, c: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`Qwen2.hf_extra`."""
        moe = c["moe"]
        return {**super().hf_extra(c), "qkv_bias": bool(c.get("qkv_bias")), "num_experts": moe["num_experts"],
                "moe_intermediate_size": c["ffn_hidden_size"], "shared_expert_intermediate_size":
                moe["shared_expert_size"], "norm_topk_prob": moe.get("normalize_expert_weights") is not None,
                "mlp_only_layers": [], "decoder_sparse_step": 1, **moe_fields(c)}

    def ffn_parts(self, c: dict[str, Any], layer: int, ffn_bias: bool, names: Collection[str] | None) -> WeightParts:
        """See :meth:`Qwen2.ffn_parts`: the routed experts, then ``mlp.shared_expert.*`` and its gate."""
        out = qwen_expert_parts(c, layer, names)
        src, dst = f"blocks.{layer}.ffn.moe.shared_expert.", f"model.layers.{layer}.mlp.shared_expert"
        width, d = c["moe"]["shared_expert_size"], c["d_model"]
        for proj, rows in (("gate_proj", width), ("up_proj", width), ("down_proj", d)):
            out[src + f"{proj}.weight"] = [Part(f"{dst}.{proj}.weight", 0, rows)]
        out[src + "gate.weight"] = [Part(f"{dst}_gate.weight", 0, 1)]
        return out


FAMILY = Qwen2Moe()
