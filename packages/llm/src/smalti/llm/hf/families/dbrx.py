"""DBRX (``DbrxForCausalLM``): LayerNorm without bias, a fused ``Wqkv`` (grouped-query, ``attn_config.kv_n_heads``)
clipped to ``attn_config.clip_qkv`` before RoPE, never-tied embeddings, and in every block a mixture of SwiGLU
experts on smalti-moe's dropless layer.

Its router takes the softmax over every expert, keeps the top ``ffn_config.moe_top_k`` and divides them by their
``moe_normalize_expert_weights``-norm (any p, or none); ``moe_jitter_eps`` multiplies the block's input (router
and experts) by U(1-eps, 1+eps) in training only; its auxiliary loss is ``load_balancing_loss_func`` over every
layer's router logits, times ``ffn_config.moe_loss_weight``, added when ``output_router_logits``.

The experts are stored fused, each ``[E * ffn, d]``: ``ffn.experts.mlp.w1`` (gate) and ``v1`` (up) as ``[out,
in]`` per expert, ``w2`` (down) as ``[in, out]``; they map onto smalti-moe's ``w1 [E, d, 2 ffn]`` and ``w2 [E,
ffn, d]`` with ``merged`` parts, so each rank reads only its experts' rows.

``transformers`` 5.24 takes the rotary base from ``rope_parameters`` and ignores ``attn_config.rope_theta`` (which
Databricks' own folders set to 500000 without ``rope_parameters``): a folder where the two disagree is refused
naming ``attn_config.rope_theta`` rather than guessing which one its author meant.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.hf.families.experts import moe_options, moe_problems
from smalti.llm.hf.families.rope import hf_rope_scaling, read_rope
from smalti.llm.hf.family import Family, Part, WeightParts

#: fields of ``attn_config`` / ``ffn_config`` that are bookkeeping of ``transformers``' sub-configs, not shape
_SUB_CONFIG_BOOKKEEPING = {
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "hidden_size",
}
_ATTN_FIELDS = {"attn_pdrop", "clip_qkv", "kv_n_heads", "rope_theta"}
_FFN_FIELDS = {"ffn_act_fn", "ffn_hidden_size", "moe_num_experts", "moe_top_k", "moe_jitter_eps", "moe_loss_weight",
               "moe_normalize_expert_weights"}
_DEFAULT_THETA = 10000.0


def _sub_config(cfg: dict[str, Any], key: str, known: set[str], path: Path) -> dict[str, Any]:
    """``cfg[key]`` (``attn_config`` or ``ffn_config``), refusing a field smalti does not know the meaning of."""
    sub = dict(cfg.get(key) or {})
    unknown = sorted(set(sub) - known - _SUB_CONFIG_BOOKKEEPING)
    for field in unknown:
        value = sub[field]
        if value not in (None, False, 0, {}, []):  # e.g. uniform_expert_assignment=true, moe_weight_parallelism
            raise ConversionError(f"{path}: {key}.{field}={value!r} is not supported by smalti's DBRX (it is not "
                                  "a field transformers' DbrxForCausalLM reads); remove it")
    return sub


def _rope(cfg: dict[str, Any], attn: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """The rotary base and scaling transformers uses, checked against ``attn_config.rope_theta``."""
    theta, scaling = read_rope({"rope_parameters": cfg.get("rope_parameters") or {"rope_theta": _DEFAULT_THETA}},
                               path)
    legacy = attn.get("rope_theta")
    if legacy is not None and float(legacy) != theta:
        raise ConversionError(
            f"{path}: attn_config.rope_theta={legacy} differs from the rotary base transformers uses "
            f"(rope_parameters.rope_theta={theta}; transformers 5 ignores attn_config.rope_theta); set "
            f"rope_parameters to {{\"rope_type\": \"default\", \"rope_theta\": {legacy}}} if the model was trained "
            "with it")
    return theta, scaling


class Dbrx(Family):
    """``DbrxForCausalLM``."""

    model_type = "dbrx"
    architecture = "DbrxForCausalLM"
    description = "DBRX (MoE)"
    ffn = "moe"
    expert_lora_refusal = (
        "transformers' DbrxExperts reads ffn.experts.mlp.w1/v1/w2 itself and passes slices to the expert module, so "
        "PEFT 0.21's target_parameters wrapper on them fails in forward ('ParamWrapper' object has no attribute "
        "'v1'), and it would see each stacked [experts * ffn, d] weight as one matrix with one lora_A shared by "
        "every expert, not a rank-r update per expert")

    # ----------------------------------------------------------------- config.json -> smalti

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """See :meth:`Family.llm_kwargs`."""
        if cfg.get("quantization_config"):
            raise ConversionError(f"{path}: quantization_config is set; give the unquantised model's folder")
        attn = _sub_config(cfg, "attn_config", _ATTN_FIELDS, path)
        ffn = _sub_config(cfg, "ffn_config", _FFN_FIELDS, path)
        for key, value in (("resid_pdrop", cfg.get("resid_pdrop")), ("emb_pdrop", cfg.get("emb_pdrop")),
                           ("attn_config.attn_pdrop", attn.get("attn_pdrop"))):
            if value:
                raise ConversionError(f"{path}: {key}={value} is not supported (smalti's model has no dropout); "
                                      "set it to 0")
        if cfg.get("tie_word_embeddings"):
            raise ConversionError(f"{path}: tie_word_embeddings=true is not supported (DBRX never ties them)")
        act = dict(ffn.get("ffn_act_fn") or {"name": "silu"})
        if act != {"name": "silu"}:
            raise ConversionError(f"{path}: ffn_config.ffn_act_fn={act!r} is not supported (smalti's DBRX experts "
                                  "use {'name': 'silu'})")
        d, n_heads = cfg["d_model"], cfg["n_heads"]
        kv_heads = attn.get("kv_n_heads", 1)
        if d % n_heads or n_heads % kv_heads:
            raise ConversionError(f"{path}: n_heads={n_heads} must divide d_model={d} and be a multiple of "
                                  f"attn_config.kv_n_heads={kv_heads}")
        experts, top_k = ffn.get("moe_num_experts", 4), ffn.get("moe_top_k", 1)
        jitter = ffn.get("moe_jitter_eps") or 0.0
        if not 0 <= jitter < 1:
            raise ConversionError(f"{path}: ffn_config.moe_jitter_eps={jitter} is not supported (smalti-moe takes "
                                  "0 <= jitter < 1)")
        p = ffn.get("moe_normalize_expert_weights", 1.0)
        if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or p <= 0):
            raise ConversionError(f"{path}: ffn_config.moe_normalize_expert_weights={p!r} is not supported (smalti "
                                  "takes a p > 0 for the p-norm the kept weights are divided by, or null)")
        losses = {"router_aux_loss_coef": ffn.get("moe_loss_weight", 0.01),
                  "output_router_logits": cfg.get("output_router_logits", False)}
        moe = moe_options(losses, path, experts, top_k, p is not None, jitter)
        moe["normalize_expert_weights"] = None if p is None else float(p)
        theta, scaling = _rope(cfg, attn, path)
        return {
            "d_model": d, "n_heads": n_heads, "n_kv_heads": kv_heads, "n_layers": cfg["n_layers"],
            "vocab_size": cfg["vocab_size"], "max_seq_len": cfg.get("max_seq_len", 2048),
            "ffn_hidden_size": ffn.get("ffn_hidden_size", 3584), "position": "rope", "rope_theta": theta,
            "rope_scaling": scaling, "norm_type": "layernorm", "norm_eps": 1e-5, "bias": False, "ffn_type": "moe",
            "activation": "silu", "clip_qkv": attn.get("clip_qkv"), "tie_embeddings": False,
            "init_std": cfg.get("initializer_range", 0.02), "moe": moe,
        }

    # ----------------------------------------------------------------- smalti -> config.json

    def problems(self, config: dict[str, Any]) -> list[str]:
        """See :meth:`Family.problems`."""
        c = config
        out = []
        if c["position"] != "rope":
            out.append(f"position={c['position']!r} (it uses rope)")
        if c["norm_type"] not in ("layernorm", "low_precision_layernorm"):
            out.append(f"norm_type={c['norm_type']!r} (it uses layernorm)")
        if c["ffn_type"] != "moe" or c["activation"] != "silu":
            out.append(f"ffn_type={c['ffn_type']!r}/activation={c['activation']!r} (it uses moe/silu)")
        for key in ("bias", "attn_bias", "qkv_bias", "ffn_bias", "qk_norm", "softmax_scale", "embed_scale",
                    "post_norms", "rope_local_theta", "sliding_window", "tie_embeddings"):
            if c.get(key):
                out.append(f"{key}={c[key]!r} (it has none)")
        if c.get("head_dim") not in (None, c["d_model"] // c["n_heads"]):
            out.append(f"head_dim={c['head_dim']} (it has d_model / n_heads)")
        moe = c.get("moe") or {}
        renorm = moe.get("normalize_expert_weights")
        # any p-norm is DBRX's: check the rest against a sum-to-one router
        return out + moe_problems({**c, "moe": {**moe, "normalize_expert_weights": None if renorm is None else 1}})

    def hf_config(self, config: dict[str, Any], dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
        """See :meth:`Family.hf_config`."""
        c = config
        moe = c["moe"]
        rope = hf_rope_scaling(c["rope_scaling"]) or {"rope_type": "default"}
        out: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type, "d_model": c["d_model"],
            "n_heads": c["n_heads"], "n_layers": c["n_layers"], "max_seq_len": c["max_seq_len"],
            "vocab_size": c["vocab_size"], "resid_pdrop": 0.0, "emb_pdrop": 0.0, "tie_word_embeddings": False,
            "attn_config": {"attn_pdrop": 0.0, "clip_qkv": c.get("clip_qkv"), "kv_n_heads": c["n_kv_heads"],
                            "rope_theta": c["rope_theta"]},
            "ffn_config": {"ffn_act_fn": {"name": "silu"}, "ffn_hidden_size": c["ffn_hidden_size"],
                           "moe_num_experts": moe["num_experts"], "moe_top_k": moe["top_k"],
                           "moe_jitter_eps": moe.get("router_jitter") or None,
                           "moe_loss_weight": moe.get("lbl_weight", 0.01),
                           "moe_normalize_expert_weights": moe.get("normalize_expert_weights")},
            "rope_parameters": {**rope, "rope_theta": c["rope_theta"]},
            "output_router_logits": moe.get("load_balancing", "aux_loss") == "aux_loss",
            "initializer_range": c["init_std"], "torch_dtype": dtype, "use_cache": True,
        }
        if eos_token_id is not None:
            out["eos_token_id"] = eos_token_id
        return out

    # ----------------------------------------------------------------- weight names

    def weight_parts(self, config: dict[str, Any], names: Collection[str] | None = None) -> WeightParts:
        """See :meth:`Family.weight_parts`."""
        c = config
        d, vocab, hidden, experts = c["d_model"], c["vocab_size"], c["ffn_hidden_size"], c["moe"]["num_experts"]
        qkv = d + 2 * c["n_kv_heads"] * (d // c["n_heads"])
        out: WeightParts = {"wte.weight": [Part("transformer.wte.weight", 0, vocab)]}
        for i in range(c["n_layers"]):
            src, dst = f"blocks.{i}.", f"transformer.blocks.{i}."
            block = dst + "norm_attn_norm."
            out[src + "norm_1.weight"] = [Part(block + "norm_1.weight", 0, d)]
            out[src + "attn.wqkv.weight"] = [Part(block + "attn.Wqkv.weight", 0, qkv)]
            out[src + "attn.out_proj.weight"] = [Part(block + "attn.out_proj.weight", 0, d)]
            out[src + "norm_2.weight"] = [Part(block + "norm_2.weight", 0, d)]
            moe, mlp = src + "ffn.moe.", dst + "ffn.experts.mlp."
            out[moe + "router.gate.weight"] = [Part(dst + "ffn.router.layer.weight", 0, experts)]
            out[moe + "w1"] = [Part(mlp + "w1", 0, experts, transposed=True, cols=(0, hidden), merged=True),
                               Part(mlp + "v1", 0, experts, transposed=True, cols=(hidden, 2 * hidden), merged=True)]
            out[moe + "w2"] = [Part(mlp + "w2", 0, experts, merged=True)]
        out["norm_f.weight"] = [Part("transformer.norm_f.weight", 0, d)]
        out["lm_head.weight"] = [Part("lm_head.weight", 0, vocab)]
        return out


FAMILY = Dbrx()
