"""Gemma 3 (text): Llama's projections with Gemma's own pieces, each an :class:`~smalti.llm.LLM` option:

* RMSNorm scaling by ``1 + weight`` (``norm_type: rmsnorm_plus_one``), also as the per-head QK-norm;
* "sandwich" norms: each block normalises its attention and MLP outputs before the residual add
  (``post_attention_layernorm``, ``post_feedforward_layernorm``; ``pre_feedforward_layernorm`` is smalti's
  ``norm_2``), ``post_norms: true``;
* input embeddings scaled by ``sqrt(hidden_size)`` (``embed_scale``);
* GeGLU with the tanh-approximated GELU (``hidden_activation: gelu_pytorch_tanh``);
* attention scaled by ``query_pre_attn_scalar ** -0.5`` (``softmax_scale``);
* local (sliding-window) and global layers as ``layer_types`` (or ``sliding_window_pattern``) say
  (``window_layers``), the local ones with their own RoPE base (``rope_local_theta``).

Logit soft-capping (``final_logit_softcapping``, ``attn_logit_softcapping``: Gemma 2's, unset in Gemma 3) and
bidirectional attention are refused naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.hf.families.llama import Llama, head_dim
from smalti.llm.hf.families.rope import hf_rope_scaling, read_rope
from smalti.llm.hf.family import Family, Part, WeightParts


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None, float]:
    """``(global theta, global scaling, local theta)`` from ``rope_parameters`` per layer type (transformers 5)
    or ``rope_theta`` + ``rope_scaling`` + ``rope_local_base_freq`` (transformers 4)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        theta, scaling = read_rope({"rope_parameters": params.get("full_attention") or {}}, path)
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ConversionError(f"{path}: rope_parameters.sliding_attention.rope_type={local['rope_type']!r} is "
                                  "not supported (smalti's local layers use the plain rotary embedding)")
        return theta, scaling, float(local.get("rope_theta", 10000.0))
    theta, scaling = read_rope(cfg, path)
    return theta, scaling, float(cfg.get("rope_local_base_freq", 10000.0))


def _window_layers(cfg: dict[str, Any], n_layers: int) -> list[bool]:
    types = cfg.get("layer_types")
    if not types:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    return [t == "sliding_attention" for t in types]


class Gemma3(Family):
    """``Gemma3ForCausalLM`` (``model_type: gemma3_text``)."""

    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    description = "Gemma 3 text"

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """See :meth:`Family.llm_kwargs`."""
        if cfg.get("quantization_config"):
            raise ConversionError(f"{path}: quantization_config is set; give the unquantised model's folder")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ConversionError(f"{path}: hidden_activation={act!r} is not supported (Gemma 3 in smalti uses "
                                  "gelu_pytorch_tanh)")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(key) is not None:
                raise ConversionError(f"{path}: {key}={cfg[key]!r} is not supported (smalti has no logit "
                                      "soft-capping); set it to null")
        if cfg.get("use_bidirectional_attention"):
            raise ConversionError(f"{path}: use_bidirectional_attention=true is not supported (smalti is causal)")
        for key, value in cfg.items():
            if "dropout" in key and isinstance(value, int | float) and value:
                raise ConversionError(f"{path}: {key}={value} is not supported (smalti's model has no dropout); "
                                      "set it to 0")
        hidden, n_heads, n_layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        hd = cfg.get("head_dim") or 256
        theta, scaling, local_theta = _rope(cfg, path)
        windows = _window_layers(cfg, n_layers)
        if len(windows) != n_layers:
            raise ConversionError(f"{path}: layer_types has {len(windows)} entries for num_hidden_layers={n_layers}")
        window = cfg.get("sliding_window") if any(windows) else None
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ConversionError(f"{path}: sliding_window={window!r} must be a positive int or null")
        attn_bias = bool(cfg.get("attention_bias", False))
        return {
            "d_model": hidden, "n_heads": n_heads, "n_kv_heads": cfg.get("num_key_value_heads") or n_heads,
            "n_layers": n_layers, "vocab_size": cfg["vocab_size"],
            "max_seq_len": cfg.get("max_position_embeddings", 2048), "ffn_hidden_size": cfg["intermediate_size"],
            "position": "rope", "rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta,
            "norm_type": "rmsnorm_plus_one", "norm_eps": cfg.get("rms_norm_eps", 1e-6), "ffn_type": "glu",
            "activation": "gelu_tanh", "bias": False, "attn_bias": attn_bias, "qkv_bias": attn_bias,
            "ffn_bias": False, "qk_norm": True, "post_norms": True, "embed_scale": math.sqrt(hidden),
            "softmax_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5, "sliding_window": window,
            "window_layers": windows, "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "init_std": cfg.get("initializer_range", 0.02), "head_dim": hd,
        }

    def problems(self, config: dict[str, Any]) -> list[str]:
        """See :meth:`Family.problems`."""
        c = config
        out = []
        wanted = {"position": "rope", "norm_type": "rmsnorm_plus_one", "ffn_type": "glu", "activation": "gelu_tanh",
                  "qk_norm": True, "post_norms": True, "embed_scale": math.sqrt(c["d_model"])}
        for key, value in wanted.items():
            if c.get(key) != value:
                out.append(f"{key}={c.get(key)!r} (Gemma 3 has {value!r})")
        if c.get("ffn_bias") or c.get("qkv_bias") != c.get("attn_bias"):
            out.append("biases other than attention_bias on q/k/v/o")
        if c.get("clip_qkv") or c.get("moe"):
            out.append("clip_qkv or a mixture of experts")
        return out

    def hf_config(self, config: dict[str, Any], dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
        """See :meth:`Family.hf_config`."""
        c = config
        windows = c.get("window_layers") or [c.get("sliding_window") is not None] * c["n_layers"]
        scalar = (c.get("softmax_scale") or head_dim(c) ** -0.5) ** -2
        scalar = round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar  # transformers wants an int
        out: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type, "hidden_size": c["d_model"],
            "intermediate_size": c["ffn_hidden_size"], "num_attention_heads": c["n_heads"],
            "num_key_value_heads": c["n_kv_heads"], "num_hidden_layers": c["n_layers"], "head_dim": head_dim(c),
            "vocab_size": c["vocab_size"], "max_position_embeddings": c["max_seq_len"], "rms_norm_eps": c["norm_eps"],
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
            "sliding_window": c.get("sliding_window") or 4096,
            "layer_types": ["sliding_attention" if w else "full_attention" for w in windows],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": c["rope_theta"],
                                   **(hf_rope_scaling(c["rope_scaling"]) or {})},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": c.get("rope_local_theta") or c["rope_theta"]},
            },
            "attention_bias": bool(c.get("attn_bias")), "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "tie_word_embeddings": bool(c["tie_embeddings"]),
            "initializer_range": c["init_std"], "torch_dtype": dtype, "use_cache": True,
        }
        if eos_token_id is not None:
            out["eos_token_id"] = eos_token_id
        return out

    def weight_parts(self, config: dict[str, Any], names: Collection[str] | None = None) -> WeightParts:
        """See :meth:`Family.weight_parts`: Llama's names, with the four norms of a Gemma block."""
        out = Llama().weight_parts(config)
        d = config["d_model"]
        for i in range(config["n_layers"]):
            src, dst = f"blocks.{i}.", f"model.layers.{i}."
            out[src + "norm_2.weight"] = [Part(dst + "pre_feedforward_layernorm.weight", 0, d)]
            out[src + "post_attn_norm.weight"] = [Part(dst + "post_attention_layernorm.weight", 0, d)]
            out[src + "post_ffn_norm.weight"] = [Part(dst + "post_feedforward_layernorm.weight", 0, d)]
        return out


FAMILY = Gemma3()
