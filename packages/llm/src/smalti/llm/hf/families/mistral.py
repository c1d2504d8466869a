"""Mistral: Llama's shape without biases, with an optional sliding window on every layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from smalti.llm.hf.families.llama import LlamaLike


class Mistral(LlamaLike):
    """``MistralForCausalLM``."""

    model_type = "mistral"
    architecture = "MistralForCausalLM"
    description = "Mistral"

    def sliding_window(self, cfg: dict[str, Any], path: Path) -> int | None:
        """See :meth:`LlamaLike.sliding_window`: Mistral's applies to every layer."""
        return cfg.get("sliding_window")

    def shape_problems(self, c: dict[str, Any]) -> list[str]:
        """See :meth:`LlamaLike.shape_problems`."""
        out = []
        if c.get("sliding_window") is None:
            out.append("no sliding_window (a windowless model exports as Llama)")
        if c.get("attn_bias") or c.get("qkv_bias") or c.get("ffn_bias"):
            out.append("biases (Mistral has none)")
        return out

    def hf_extra(self, c: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`LlamaLike.hf_extra`."""
        return {"sliding_window": c["sliding_window"]}


FAMILY = Mistral()
