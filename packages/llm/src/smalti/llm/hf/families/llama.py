"""Llama (1/2/3/3.1), and the shared shape of the Llama-like families (RoPE, RMSNorm, SwiGLU, fused q/k/v).

Both sides use the half-split rotary convention, so the attention weights map one to one: smalti's fused
``wqkv`` is Hugging Face's ``q_proj``, ``k_proj`` and ``v_proj`` stacked by rows.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.hf.families.rope import hf_rope_scaling, read_rope
from smalti.llm.hf.family import Family, Part, WeightParts


def head_dim(config: dict[str, Any]) -> int:
    """The attention head size of a smalti model ``config``."""
    return config.get("head_dim") or config["d_model"] // config["n_heads"]


class LlamaLike(Family):
    """What Llama, Mistral, Qwen2 and Qwen3 share; a subclass states its biases, window and QK-norm."""

    #: whether the family normalises queries and keys (Qwen3, OLMoE), per ``head`` or over ``all`` of each
    qk_norm = False
    qk_norm_scope = "head"

    # ----------------------------------------------------------------- config.json -> smalti

    def biases(self, cfg: dict[str, Any]) -> dict[str, bool]:
        """``attn_bias``, ``qkv_bias`` and ``ffn_bias`` from ``cfg``."""
        return {"attn_bias": False, "qkv_bias": False, "ffn_bias": False}

    def sliding_window(self, cfg: dict[str, Any], path: Path) -> int | None:
        """The window every layer uses, or None; mixed layers are refused naming the field."""
        return None

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """See :meth:`Family.llm_kwargs`."""
        if cfg.get("quantization_config"):
            raise ConversionError(f"{path}: quantization_config is set; give the unquantised model's folder")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConversionError(f"{path}: hidden_act={act!r} is not supported ({self.model_type} in smalti uses silu)")
        for key, value in cfg.items():
            if "dropout" in key and isinstance(value, int | float) and value:
                raise ConversionError(f"{path}: {key}={value} is not supported (smalti's model has no dropout); "
                                      "set it to 0")
        hidden, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        hd = cfg.get("head_dim") or hidden // n_heads
        theta, scaling = read_rope(cfg, path)
        window = self.sliding_window(cfg, path)
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ConversionError(f"{path}: sliding_window={window!r} must be a positive int or null")
        return {
            "d_model": hidden, "n_heads": n_heads, "n_kv_heads": cfg.get("num_key_value_heads") or n_heads,
            "n_layers": cfg["num_hidden_layers"], "vocab_size": cfg["vocab_size"],
            "max_seq_len": cfg.get("max_position_embeddings", 2048), "ffn_hidden_size": cfg["intermediate_size"],
            "position": "rope", "rope_theta": theta, "rope_scaling": scaling, "norm_type": "rmsnorm",
            "norm_eps": cfg.get("rms_norm_eps", 1e-6), "ffn_type": "glu", "activation": "silu", "bias": False,
            **self.biases(cfg), "qk_norm": self.qk_norm, "qk_norm_scope": self.qk_norm_scope, "sliding_window": window,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "init_std": cfg.get("initializer_range", 0.02), "head_dim": hd if hd * n_heads != hidden else None,
        }

    # ----------------------------------------------------------------- smalti -> config.json

    def shape_problems(self, c: dict[str, Any]) -> list[str]:
        """Problems particular to the subclass (biases, window)."""
        return []

    def problems(self, config: dict[str, Any]) -> list[str]:
        """See :meth:`Family.problems`."""
        c = config
        out = []
        if c["position"] != "rope":
            out.append(f"position={c['position']!r} (it uses rope)")
        if c["norm_type"] not in ("rmsnorm", "low_precision_rmsnorm"):
            out.append(f"norm_type={c['norm_type']!r} (it uses rmsnorm)")
        if c["ffn_type"] != self.ffn or c["activation"] != "silu":
            out.append(f"ffn_type={c['ffn_type']!r}/activation={c['activation']!r} (it uses {self.ffn}/silu)")
        if bool(c["qk_norm"]) != self.qk_norm:
            out.append(f"qk_norm={c['qk_norm']!r} (it has {'' if self.qk_norm else 'no '}QK-norm)")
        elif self.qk_norm and c.get("qk_norm_scope", "head") != self.qk_norm_scope:
            out.append(f"qk_norm_scope={c.get('qk_norm_scope', 'head')!r} (it normalises {self.qk_norm_scope})")
        for key in ("clip_qkv", "softmax_scale", "embed_scale", "post_norms", "rope_local_theta"):
            if c.get(key):
                out.append(f"{key}={c[key]!r} (it has none)")
        if c.get("window_layers") is not None and not all(c["window_layers"]):
            out.append("window_layers (its window, if any, covers every layer)")
        return out + self.shape_problems(c)

    def hf_extra(self, c: dict[str, Any]) -> dict[str, Any]:
        """The subclass's own ``config.json`` fields (biases, window)."""
        return {}

    def hf_config(self, config: dict[str, Any], dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
        """See :meth:`Family.hf_config`."""
        c = config
        out: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type, "hidden_size": c["d_model"],
            "intermediate_size": c["ffn_hidden_size"], "num_attention_heads": c["n_heads"],
            "num_key_value_heads": c["n_kv_heads"], "num_hidden_layers": c["n_layers"], "head_dim": head_dim(c),
            "vocab_size": c["vocab_size"], "max_position_embeddings": c["max_seq_len"], "rms_norm_eps": c["norm_eps"],
            "rope_theta": c["rope_theta"], "rope_scaling": hf_rope_scaling(c["rope_scaling"]), "hidden_act": "silu",
            "tie_word_embeddings": bool(c["tie_embeddings"]), "initializer_range": c["init_std"],
            "torch_dtype": dtype, "use_cache": True, **self.hf_extra(c),
        }
        if eos_token_id is not None:
            out["eos_token_id"] = eos_token_id
        return out

    # ----------------------------------------------------------------- weight names

    def ffn_parts(self, c: dict[str, Any], layer: int, ffn_bias: bool, names: Collection[str] | None) -> WeightParts:
        """The weight parts of layer ``layer``'s FFN (SwiGLU here; the MoE families map their experts)."""
        src, dst = f"blocks.{layer}.", f"model.layers.{layer}."
        out: WeightParts = {}
        for kind in ("weight", "bias") if ffn_bias else ("weight",):
            for proj, rows in (("gate_proj", c["ffn_hidden_size"]), ("up_proj", c["ffn_hidden_size"]),
                               ("down_proj", c["d_model"])):
                out[src + f"ffn.{proj}.{kind}"] = [Part(dst + f"mlp.{proj}.{kind}", 0, rows)]
        return out

    def weight_parts(self, config: dict[str, Any], names: Collection[str] | None = None) -> WeightParts:
        """See :meth:`Family.weight_parts`."""
        c = config
        hd = head_dim(c)
        q, kv = c["n_heads"] * hd, c["n_kv_heads"] * hd
        bias = bool(c.get("bias", False))
        attn_bias = bias if c.get("attn_bias") is None else bool(c["attn_bias"])
        qkv_bias = attn_bias if c.get("qkv_bias") is None else bool(c["qkv_bias"])
        ffn_bias = bias if c.get("ffn_bias") is None else bool(c["ffn_bias"])
        d, vocab = c["d_model"], c["vocab_size"]
        out: WeightParts = {"wte.weight": [Part("model.embed_tokens.weight", 0, vocab)]}
        for i in range(c["n_layers"]):
            src, dst = f"blocks.{i}.", f"model.layers.{i}."
            out[src + "norm_1.weight"] = [Part(dst + "input_layernorm.weight", 0, d)]
            for kind in ("weight", "bias") if qkv_bias else ("weight",):
                out[src + f"attn.wqkv.{kind}"] = [
                    Part(dst + f"self_attn.{p}_proj.{kind}", a, b)
                    for p, a, b in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv))
                ]
            for kind in ("weight", "bias") if attn_bias else ("weight",):
                out[src + f"attn.out_proj.{kind}"] = [Part(dst + f"self_attn.o_proj.{kind}", 0, d)]
            if c.get("qk_norm"):
                widths = (hd, hd) if c.get("qk_norm_scope", "head") == "head" else (q, kv)
                for p, width in zip(("q", "k"), widths, strict=True):
                    out[src + f"attn.{p}_norm.weight"] = [Part(dst + f"self_attn.{p}_norm.weight", 0, width)]
            out[src + "norm_2.weight"] = [Part(dst + "post_attention_layernorm.weight", 0, d)]
            out.update(self.ffn_parts(c, i, ffn_bias, names))
        out["norm_f.weight"] = [Part("model.norm.weight", 0, d)]
        if not c.get("tie_embeddings", True):
            out["lm_head.weight"] = [Part("lm_head.weight", 0, vocab)]
        return out


class Llama(LlamaLike):
    """``LlamaForCausalLM``: optional ``attention_bias`` (q/k/v/o) and ``mlp_bias``; no window."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
    description = "Llama 1/2/3/3.1"

    def biases(self, cfg: dict[str, Any]) -> dict[str, bool]:
        """See :meth:`LlamaLike.biases`."""
        attn = bool(cfg.get("attention_bias", False))
        return {"attn_bias": attn, "qkv_bias": attn, "ffn_bias": bool(cfg.get("mlp_bias", False))}

    def shape_problems(self, c: dict[str, Any]) -> list[str]:
        """See :meth:`LlamaLike.shape_problems`."""
        out = []
        if c.get("sliding_window") is not None:
            out.append(f"sliding_window={c['sliding_window']} (Llama has none)")
        if c.get("qkv_bias") != c.get("attn_bias"):
            out.append("qkv_bias without attn_bias (Llama's attention_bias covers q/k/v and o)")
        return out

    def hf_extra(self, c: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`LlamaLike.hf_extra`."""
        return {"attention_bias": bool(c.get("attn_bias")), "mlp_bias": bool(c.get("ffn_bias"))}


FAMILY = Llama()
