"""MPT-style models (the ``mpt_*`` recipes: LayerNorm, GELU MLP, one key/value head per query head) as two
classes that ship with ``transformers`` (no ``trust_remote_code``):

* ALiBi positions: ``MptForCausalLM`` (``model_type: mpt``; its norms have no bias, so the model must have
  ``bias: false``, as LLM Foundry's MPT recipes do);
* learned positions (what LLM Foundry's ``mpt-*`` pretraining recipes, and so smalti's, use): ``GPT2LMHeadModel``
  (``model_type: gpt2``; the MPT port in ``transformers`` always adds ALiBi and has no position table). Missing
  biases are written as zeros, GELU is the exact one (``activation_function: gelu``), and GPT-2's ``Conv1D``
  weights are stored transposed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.hf.family import Family, Part, WeightParts


def _shape(c: dict[str, Any]) -> tuple[str, list[str]]:
    """``("mpt" | "gpt2" | "", why not)`` for a smalti model ``config``."""
    why = []
    if c.get("norm_type") not in ("layernorm", "low_precision_layernorm"):
        why.append(f"norm_type={c.get('norm_type')!r} (needs layernorm)")
    if c.get("ffn_type") != "mlp" or c.get("activation") != "gelu":
        why.append(f"ffn_type={c.get('ffn_type')!r}, activation={c.get('activation')!r} (needs a GELU mlp)")
    if c.get("moe"):
        why.append("a mixture of experts")
    if c.get("n_kv_heads", c["n_heads"]) != c["n_heads"]:
        why.append(f"n_kv_heads={c.get('n_kv_heads')} != n_heads={c['n_heads']} (no grouped-query attention)")
    if c.get("qk_norm") or c.get("sliding_window"):
        why.append("QK-norm or a sliding window")
    for key in ("embed_scale", "post_norms", "rope_local_theta"):
        if c.get(key):
            why.append(f"{key}={c[key]!r}")
    if c.get("head_dim") not in (None, c["d_model"] // c["n_heads"]):
        why.append(f"head_dim={c.get('head_dim')} (needs d_model/n_heads)")
    if c.get("softmax_scale") not in (None, (c["d_model"] // c["n_heads"]) ** -0.5):
        why.append(f"softmax_scale={c.get('softmax_scale')}")
    position = c.get("position")
    family = ""
    if position == "alibi":
        if c.get("bias"):
            why.append("bias=true with ALiBi (MptForCausalLM's norms have no bias)")
        if float(c.get("alibi_bias_max", 8)) != int(c.get("alibi_bias_max", 8)):
            why.append(f"alibi_bias_max={c.get('alibi_bias_max')} (MPT's config takes a whole number)")
        if c["ffn_hidden_size"] % c["d_model"]:
            why.append(f"ffn_hidden_size={c['ffn_hidden_size']} (MPT needs a whole multiple of d_model)")
        family = "mpt"
    elif position == "learned":
        if c.get("clip_qkv") is not None:
            why.append("clip_qkv with learned positions (GPT-2 has no QKV clipping)")
        family = "gpt2"
    else:
        why.append(f"position={position!r} (needs alibi or learned)")
    return family, why


def mpt_family(model_or_config: Any) -> str:
    """``"mpt"`` or ``"gpt2"``: the ``transformers`` family an MPT-style model (or its ``config``) exports to;
    raises :class:`ConversionError` naming what does not fit when it is not MPT-shaped."""
    c = model_or_config if isinstance(model_or_config, Mapping) else model_or_config.config
    family, why = _shape(c)
    if why:
        raise ConversionError("not exportable as a Hugging Face MPT or GPT-2 model: " + "; ".join(why))
    return family


def _common_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"norm_type": "layernorm", "norm_eps": cfg.get("layer_norm_epsilon", 1e-5), "ffn_type": "mlp",
            "activation": "gelu", "tie_embeddings": cfg.get("tie_word_embeddings", True)}


def _common_config(c: dict[str, Any], dtype: str, eos_token_id: int | None) -> dict[str, Any]:
    return {"vocab_size": c["vocab_size"], "layer_norm_epsilon": c["norm_eps"], "torch_dtype": dtype,
            "tie_word_embeddings": bool(c["tie_embeddings"]), "use_cache": True,
            "bos_token_id": eos_token_id, "eos_token_id": eos_token_id}


class _MPTShaped(Family):
    ffn = "mlp"

    def problems(self, config: dict[str, Any]) -> list[str]:
        """See :meth:`Family.problems`."""
        family, why = _shape(config)
        if not why and family != self.model_type:
            why.append(f"position={config['position']!r} exports as {family}")
        return why


class MPT(_MPTShaped):
    """``MptForCausalLM``: ALiBi, no biases."""

    model_type = "mpt"
    architecture = "MptForCausalLM"
    description = "MPT (ALiBi, no biases)"

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """See :meth:`Family.llm_kwargs`."""
        attn = cfg.get("attn_config") or {}
        if not cfg.get("no_bias", True):
            raise ConversionError(f"{path}: no_bias=false is not supported (smalti's ALiBi MPT has no biases)")
        if attn.get("qk_ln"):
            raise ConversionError(f"{path}: attn_config.qk_ln=true is not supported")
        return {"d_model": cfg["d_model"], "n_heads": cfg["n_heads"], "n_layers": cfg["n_layers"],
                "vocab_size": cfg["vocab_size"], "max_seq_len": cfg["max_seq_len"],
                "ffn_hidden_size": int(cfg["d_model"] * cfg["expansion_ratio"]), "position": "alibi",
                "alibi_bias_max": attn.get("alibi_bias_max", 8), "clip_qkv": attn.get("clip_qkv"),
                "softmax_scale": attn.get("softmax_scale"), "bias": False, **_common_kwargs(cfg)}

    def hf_config(self, config: dict[str, Any], dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
        """See :meth:`Family.hf_config`."""
        c = config
        return {**_common_config(c, dtype, eos_token_id), "architectures": [self.architecture], "model_type": "mpt",
                "d_model": c["d_model"], "n_heads": c["n_heads"], "n_layers": c["n_layers"],
                "max_seq_len": c["max_seq_len"], "expansion_ratio": c["ffn_hidden_size"] // c["d_model"],
                "no_bias": True, "learned_pos_emb": False, "norm_type": "low_precision_layernorm",
                "resid_pdrop": 0.0, "emb_pdrop": 0.0,
                "attn_config": {"alibi": True, "alibi_bias_max": int(c["alibi_bias_max"]), "clip_qkv": c["clip_qkv"],
                                "softmax_scale": c["softmax_scale"], "attn_pdrop": 0, "qk_ln": False}}

    def weight_parts(self, config: dict[str, Any], names: Collection[str] | None = None) -> WeightParts:
        """See :meth:`Family.weight_parts`."""
        c = config
        d, hidden, vocab = c["d_model"], c["ffn_hidden_size"], c["vocab_size"]
        out: WeightParts = {"wte.weight": [Part("transformer.wte.weight", 0, vocab)]}
        for i in range(c["n_layers"]):
            s, h = f"blocks.{i}", f"transformer.blocks.{i}"
            for part, rows in (("norm_1", d), ("attn.wqkv", 3 * d), ("attn.out_proj", d), ("norm_2", d),
                               ("ffn.up_proj", hidden), ("ffn.down_proj", d)):
                theirs = "attn.Wqkv" if part == "attn.wqkv" else part
                out[f"{s}.{part}.weight"] = [Part(f"{h}.{theirs}.weight", 0, rows)]
        out["norm_f.weight"] = [Part("transformer.norm_f.weight", 0, d)]
        if not c.get("tie_embeddings", True):
            out["lm_head.weight"] = [Part("lm_head.weight", 0, vocab)]
        return out


class GPT2(_MPTShaped):
    """``GPT2LMHeadModel``: learned positions, exact GELU; biases always present in the file."""

    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"
    description = "GPT-2 (exact GELU)"

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """See :meth:`Family.llm_kwargs`."""
        if cfg.get("activation_function") != "gelu":
            raise ConversionError(f"{path}: activation_function={cfg.get('activation_function')!r}; smalti's "
                                  "MPT-style models use the exact GELU ('gelu')")
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if cfg.get(key):
                raise ConversionError(f"{path}: {key}=true is not supported")
        if cfg.get("scale_attn_weights") is False:
            raise ConversionError(f"{path}: scale_attn_weights=false is not supported")
        return {"d_model": cfg["n_embd"], "n_heads": cfg["n_head"], "n_layers": cfg["n_layer"],
                "vocab_size": cfg["vocab_size"], "max_seq_len": cfg["n_positions"],
                "ffn_hidden_size": cfg.get("n_inner") or 4 * cfg["n_embd"], "position": "learned", "bias": True,
                **_common_kwargs(cfg)}

    def hf_config(self, config: dict[str, Any], dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
        """See :meth:`Family.hf_config`."""
        c = config
        return {**_common_config(c, dtype, eos_token_id), "architectures": [self.architecture], "model_type": "gpt2",
                "n_embd": c["d_model"], "n_head": c["n_heads"], "n_layer": c["n_layers"],
                "n_positions": c["max_seq_len"], "n_inner": c["ffn_hidden_size"], "activation_function": "gelu",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}

    def _names(self, c: dict[str, Any]) -> list[tuple[str, str, int, bool]]:
        """``(smalti name, GPT-2 name, rows, transposed)`` of every tensor GPT-2 has."""
        d, hidden, vocab = c["d_model"], c["ffn_hidden_size"], c["vocab_size"]
        names = [("wte.weight", "transformer.wte.weight", vocab, False),
                 ("wpe.weight", "transformer.wpe.weight", c["max_seq_len"], False)]
        for i in range(c["n_layers"]):
            s, h = f"blocks.{i}", f"transformer.h.{i}"
            for ours, theirs, rows, t in (("norm_1", "ln_1", d, False), ("attn.wqkv", "attn.c_attn", 3 * d, True),
                                          ("attn.out_proj", "attn.c_proj", d, True), ("norm_2", "ln_2", d, False),
                                          ("ffn.up_proj", "mlp.c_fc", hidden, True),
                                          ("ffn.down_proj", "mlp.c_proj", d, True)):
                names += [(f"{s}.{ours}.weight", f"{h}.{theirs}.weight", rows, t),
                          (f"{s}.{ours}.bias", f"{h}.{theirs}.bias", rows, False)]
        names += [("norm_f.weight", "transformer.ln_f.weight", d, False),
                  ("norm_f.bias", "transformer.ln_f.bias", d, False)]
        if not c.get("tie_embeddings", True):
            names.append(("lm_head.weight", "lm_head.weight", vocab, False))
        return names

    def weight_parts(self, config: dict[str, Any], names: Collection[str] | None = None) -> WeightParts:
        """See :meth:`Family.weight_parts` (without the biases a ``bias: false`` model lacks)."""
        biased = bool(config.get("bias"))
        return {ours: [Part(theirs, 0, rows, transposed=t)] for ours, theirs, rows, t in self._names(config)
                if biased or not ours.endswith(".bias")}

    def zero_tensors(self, config: dict[str, Any]) -> dict[str, list[int]]:
        """GPT-2 always has biases: a ``bias: false`` model writes them as zeros."""
        if config.get("bias"):
            return {}
        return {theirs: [rows] for ours, theirs, rows, _ in self._names(config) if ours.endswith(".bias")}


MPT_FAMILY = MPT()
GPT2_FAMILY = GPT2()
