"""The linear layers of a transformer block that LoRA can adapt, and the target names of their parts.

Shared by :mod:`smalti.llm.lora.apply` (which wraps them) and :mod:`smalti.llm.lora.peft_format` (which maps
PEFT's ``target_modules`` onto them), so that neither imports the other.
"""

from __future__ import annotations

from torch import nn


def block_linears(block: nn.Module) -> dict[str, list[tuple[str, int, int]]]:
    """A block's linear layers (by path inside the block) and their parts, named as the ``model.lora.targets`` names (:data:`smalti.llm.lora.config.TARGETS`)."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    attn = block.attn
    q = attn.n_heads * attn.head_dim
    kv = attn.n_kv_heads * attn.head_dim
    out["attn.wqkv"] = [("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)]
    out["attn.out_proj"] = [("o", 0, attn.out_proj.out_features)]
    for name in ("gate", "up", "down"):
        layer = getattr(block.ffn, f"{name}_proj", None)
        if isinstance(layer, nn.Linear):
            out[f"ffn.{name}_proj"] = [(name, 0, layer.out_features)]
    return out
