"""Qwen3 (dense): Llama's shape with a per-head RMSNorm on queries and keys (QK-norm, before the rotary
embedding), a ``head_dim`` of its own (128 whatever the width), optional biases on q/k/v/o
(``attention_bias``) and Qwen2's sliding-window rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from smalti.llm.hf.families.llama import LlamaLike
from smalti.llm.hf.families.qwen2 import qwen_sliding_window, qwen_window_fields


class Qwen3(LlamaLike):
    """``Qwen3ForCausalLM``."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    description = "Qwen3 dense"
    qk_norm = True

    def biases(self, cfg: dict[str, Any]) -> dict[str, bool]:
        """See :meth:`LlamaLike.biases`: ``attention_bias`` covers q/k/v and o; the MLP has none."""
        attn = bool(cfg.get("attention_bias", False))
        return {"attn_bias": attn, "qkv_bias": attn, "ffn_bias": False}

    def sliding_window(self, cfg: dict[str, Any], path: Path) -> int | None:
        """See :func:`~smalti.llm.hf.families.qwen2.qwen_sliding_window`."""
        return qwen_sliding_window(cfg, path)

    def shape_problems(self, c: dict[str, Any]) -> list[str]:
        """See :meth:`LlamaLike.shape_problems`."""
        out = []
        if c.get("ffn_bias"):
            out.append("ffn_bias (Qwen3's MLP has none)")
        if c.get("qkv_bias") != c.get("attn_bias"):
            out.append("qkv_bias without attn_bias (Qwen3's attention_bias covers q/k/v and o)")
        return out

    def hf_extra(self, c: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`LlamaLike.hf_extra`."""
        return {"attention_bias": bool(c.get("attn_bias")), **qwen_window_fields(c)}


FAMILY = Qwen3()
