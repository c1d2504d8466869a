"""OLMoE: Llama's attention with QK-norm over the whole query and key projections (not per head), and a
mixture of SwiGLU experts of width ``intermediate_size`` in every block, on smalti-moe's dropless layer.

Its router and auxiliary loss are Qwen3-MoE's (softmax, top-k, renormalised when ``norm_topk_prob``). A
``clip_qkv`` is refused naming it: OLMoE clips after the QK-norm, smalti before.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.hf.families.experts import moe_fields, moe_options, moe_problems
from smalti.llm.hf.families.llama import LlamaLike
from smalti.llm.hf.families.qwen3_moe import qwen_expert_parts
from smalti.llm.hf.family import WeightParts


class Olmoe(LlamaLike):
    """``OlmoeForCausalLM``."""

    model_type = "olmoe"
    architecture = "OlmoeForCausalLM"
    description = "OLMoE"
    ffn = "moe"
    qk_norm = True
    qk_norm_scope = "all"

    def biases(self, cfg: dict[str, Any]) -> dict[str, bool]:
        """See :meth:`LlamaLike.biases`: ``attention_bias`` covers q/k/v and o."""
        attn = bool(cfg.get("attention_bias", False))
        return {"attn_bias": attn, "qkv_bias": attn, "ffn_bias": False}

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """See :meth:`LlamaLike.llm_kwargs`."""
        if cfg.get("clip_qkv") is not None:
            raise ConversionError(f"{path}: clip_qkv={cfg['clip_qkv']} is not supported (OLMoE clips after the "
                                  "QK-norm, smalti before it); set it to null")
        out = super().llm_kwargs(cfg, path)
        moe = moe_options(cfg, path, cfg["num_experts"], cfg["num_experts_per_tok"],
                          bool(cfg.get("norm_topk_prob", False)))
        return {**out, "ffn_type": "moe", "moe": moe}

    def shape_problems(self, c: dict[str, Any]) -> list[str]:
        """See :meth:`LlamaLike.shape_problems`."""
        out = moe_problems(c)
        if c.get("ffn_bias") or c.get("qkv_bias") != c.get("attn_bias"):
            out.append("biases other than attention_bias's q/k/v/o (OLMoE has those only)")
        if c.get("sliding_window") is not None or c.get("head_dim"):
            out.append("a sliding_window or a head_dim apart from hidden_size / heads (OLMoE has neither)")
        return out

    def hf_extra(self, c: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`LlamaLike.hf_extra`."""
        moe = c["moe"]
        return {"attention_bias": bool(c.get("attn_bias")), "clip_qkv": None, "num_experts": moe["num_experts"],
                "norm_topk_prob": moe.get("normalize_expert_weights") is not None, **moe_fields(c)}

    def ffn_parts(self, c: dict[str, Any], layer: int, ffn_bias: bool, names: Collection[str] | None) -> WeightParts:
        """See :meth:`LlamaLike.ffn_parts`: Qwen-MoE's names."""
        return qwen_expert_parts(c, layer, names)


FAMILY = Olmoe()
