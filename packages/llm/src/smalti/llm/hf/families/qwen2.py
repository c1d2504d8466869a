"""Qwen2: Llama's shape with a bias on q/k/v only, and a sliding window smalti reproduces when every layer has it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.hf.families.llama import LlamaLike


def qwen_sliding_window(cfg: dict[str, Any], path: Path) -> int | None:
    """Qwen's window applies only with ``use_sliding_window``, and then to the layers from ``max_window_layers``
    on (or as ``layer_types`` says): smalti reproduces it when that is every layer."""
    if not cfg.get("use_sliding_window"):
        return None
    window = cfg.get("sliding_window")
    n = cfg.get("num_hidden_layers", 0)
    first = cfg.get("max_window_layers", 0)
    types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if window is not None and set(types) != {"sliding_attention"}:
        raise ConversionError(
            f"{path}: use_sliding_window=true with max_window_layers={first} (layer_types) mixes full and "
            "sliding-window layers, which smalti does not reproduce; use max_window_layers=0 or "
            "use_sliding_window=false"
        )
    return window


def qwen_window_fields(c: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` window fields of a smalti model (every layer windowed, or none)."""
    window = c.get("sliding_window")
    if window is None:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": c["n_layers"]}
    return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 0}


class Qwen2(LlamaLike):
    """``Qwen2ForCausalLM``."""

    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    description = "Qwen2/2.5"

    def biases(self, cfg: dict[str, Any]) -> dict[str, bool]:
        """See :meth:`LlamaLike.biases`: q/k/v only."""
        return {"attn_bias": False, "qkv_bias": True, "ffn_bias": False}

    def sliding_window(self, cfg: dict[str, Any], path: Path) -> int | None:
        """See :func:`qwen_sliding_window`."""
        return qwen_sliding_window(cfg, path)

    def shape_problems(self, c: dict[str, Any]) -> list[str]:
        """See :meth:`LlamaLike.shape_problems`."""
        if not c.get("qkv_bias") or c.get("attn_bias") or c.get("ffn_bias"):
            return ["biases other than on q/k/v alone (Qwen2 has exactly those)"]
        return []

    def hf_extra(self, c: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`LlamaLike.hf_extra`."""
        return qwen_window_fields(c)


FAMILY = Qwen2()
