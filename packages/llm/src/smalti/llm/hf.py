"""Hugging Face Llama interop: export an :class:`LLM` to a local folder (``config.json`` +
``model.safetensors``) that ``transformers`` loads as ``LlamaForCausalLM``, and import such a folder back.

The attention weights map one to one because both sides use the half-split rotary convention; smalti's fused
``wqkv`` is split into ``q_proj``, ``k_proj`` and ``v_proj``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from smalti.llm.errors import ConversionError
from smalti.llm.model.transformer import LLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_exportable(model: LLM) -> None:
    c = model.config
    problems = []
    if c["position"] != "rope":
        problems.append(f"position={c['position']!r} (Llama uses rope)")
    if c["norm_type"] not in ("rmsnorm", "low_precision_rmsnorm"):
        problems.append(f"norm_type={c['norm_type']!r} (Llama uses rmsnorm)")
    if c["ffn_type"] != "glu" or c["activation"] != "silu":
        problems.append(f"ffn_type={c['ffn_type']!r}/activation={c['activation']!r} (Llama uses glu/silu)")
    for key in ("qk_norm", "clip_qkv", "softmax_scale"):
        if c[key]:
            problems.append(f"{key}={c[key]!r} (Llama has none)")
    if problems:
        raise ConversionError("this model cannot be exported as a Hugging Face Llama: " + "; ".join(problems))


def llama_config(model: LLM, dtype: str = "float32", eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to ``model``."""
    _check_exportable(model)
    c = model.config
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c["d_model"],
        "intermediate_size": c["ffn_hidden_size"],
        "num_attention_heads": c["n_heads"],
        "num_key_value_heads": c["n_kv_heads"],
        "num_hidden_layers": c["n_layers"],
        "head_dim": c["d_model"] // c["n_heads"],
        "vocab_size": c["vocab_size"],
        "max_position_embeddings": c["max_seq_len"],
        "rms_norm_eps": c["norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": _hf_rope_scaling(c["rope_scaling"]),
        "hidden_act": "silu",
        "attention_bias": bool(c.get("attn_bias", c["bias"])),
        "mlp_bias": bool(c.get("ffn_bias", c["bias"])),
        "tie_word_embeddings": bool(c["tie_embeddings"]),
        "initializer_range": c["init_std"],
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    return config


def _hf_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    out = dict(scaling)
    out["rope_type"] = out.pop("type", out.get("rope_type"))
    return out


def to_hf_state_dict(model: LLM) -> dict[str, torch.Tensor]:
    """``model``'s weights under Hugging Face Llama names."""
    c = model.config
    hd = c["d_model"] // c["n_heads"]
    q_size, kv_size = c["n_heads"] * hd, c["n_kv_heads"] * hd
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm_f.weight"]}
    if not c["tie_embeddings"]:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(c["n_layers"]):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "norm_1.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "norm_2.weight"]
        for kind in ("weight", "bias"):
            fused = sd.get(src + f"attn.wqkv.{kind}")
            if fused is not None:  # attention biases and MLP biases are independent (attention_bias, mlp_bias)
                q, k, v = fused.split([q_size, kv_size, kv_size], dim=0)
                out[dst + f"self_attn.q_proj.{kind}"] = q
                out[dst + f"self_attn.k_proj.{kind}"] = k
                out[dst + f"self_attn.v_proj.{kind}"] = v
                out[dst + f"self_attn.o_proj.{kind}"] = sd[src + f"attn.out_proj.{kind}"]
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if src + f"ffn.{proj}.{kind}" in sd:
                    out[dst + f"mlp.{proj}.{kind}"] = sd[src + f"ffn.{proj}.{kind}"]
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: dict[str, Any], source: str) -> dict[str, torch.Tensor]:
    """Hugging Face Llama tensors ``hf`` under smalti's parameter names, for an :class:`LLM` with ``config``
    (its constructor arguments). Missing tensors raise :class:`ConversionError` naming ``source``."""

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConversionError(f"{source}: missing weight {name!r} (the config asks for it)")
        return hf[name]

    bias = bool(config.get("bias", False))
    attn_bias = config.get("attn_bias")
    ffn_bias = config.get("ffn_bias")
    attn_bias = bias if attn_bias is None else attn_bias
    ffn_bias = bias if ffn_bias is None else ffn_bias
    out = {"wte.weight": take("model.embed_tokens.weight"), "norm_f.weight": take("model.norm.weight")}
    if not config.get("tie_embeddings", True):
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(config["n_layers"]):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        out[dst + "norm_1.weight"] = take(src + "input_layernorm.weight")
        out[dst + "norm_2.weight"] = take(src + "post_attention_layernorm.weight")
        for kind in ("weight", "bias") if attn_bias else ("weight",):
            out[dst + f"attn.wqkv.{kind}"] = torch.cat([take(src + f"self_attn.{p}_proj.{kind}") for p in "qkv"], 0)
            out[dst + f"attn.out_proj.{kind}"] = take(src + f"self_attn.o_proj.{kind}")
        for kind in ("weight", "bias") if ffn_bias else ("weight",):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[dst + f"ffn.{proj}.{kind}"] = take(src + f"mlp.{proj}.{kind}")
    return out


def export_hf(model: LLM, folder: str | os.PathLike, dtype: str = "float32", tokenizer: Any = None) -> Path:
    """Write ``model`` as a Hugging Face Llama folder (written to a temporary folder, then renamed into place).

    ``tokenizer`` (a name or path for :func:`smalti.llm.tokenizer.load_tokenizer`) copies its
    ``tokenizer.json`` beside the weights.
    """
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ConversionError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    folder = Path(folder)
    eos = None
    tok_path = None
    if tokenizer is not None:
        from smalti.llm.tokenizer import BPETokenizer, load_tokenizer

        tok = load_tokenizer(tokenizer)
        eos = tok.eos_id
        tok_path = tok.path if isinstance(tok, BPETokenizer) else None
    config = llama_config(model, dtype, eos)
    tensors = {k: v.to(_DTYPES[dtype]).contiguous().cpu() for k, v in to_hf_state_dict(model).items()}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos} if eos is not None else {}) + "\n")
        if tok_path is not None:
            shutil.copyfile(tok_path, tmp / "tokenizer.json")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConversionError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(folder / name)))
    return out


def import_hf(folder: str | os.PathLike, **overrides: Any) -> LLM:
    """Build an :class:`LLM` from a local Hugging Face Llama folder (``config.json`` + safetensors), such as one
    ``LlamaForCausalLM.save_pretrained`` writes. ``overrides`` replace constructor arguments (e.g.
    ``max_seq_len``). The model is built on the meta device and filled with the folder's weights only, so no
    random fp32 copy is made first."""
    from smalti.llm.export import build_with_weights

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{folder} has no config.json; give a local Hugging Face model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{cfg_path} is not valid JSON ({exc.msg})") from exc
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise ConversionError(f"{cfg_path}: model_type={cfg.get('model_type')!r} is not supported (llama, mistral)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{cfg_path}: hidden_act={cfg['hidden_act']!r} is not supported (Llama uses silu)")
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    if head_dim * n_heads != cfg["hidden_size"]:
        raise ConversionError(f"{cfg_path}: head_dim*num_attention_heads != hidden_size is not supported")
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} if rope else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    elif scaling:
        scaling = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    attn_bias = bool(cfg.get("attention_bias", False))
    kwargs: dict[str, Any] = {
        "d_model": cfg["hidden_size"], "n_heads": n_heads, "n_kv_heads": cfg.get("num_key_value_heads") or n_heads,
        "n_layers": cfg["num_hidden_layers"], "vocab_size": cfg["vocab_size"],
        "max_seq_len": cfg.get("max_position_embeddings", 2048), "ffn_hidden_size": cfg["intermediate_size"],
        "position": "rope", "rope_theta": theta, "rope_scaling": scaling, "norm_type": "rmsnorm",
        "norm_eps": cfg.get("rms_norm_eps", 1e-5), "ffn_type": "glu", "activation": "silu",
        "bias": attn_bias, "attn_bias": attn_bias, "ffn_bias": bool(cfg.get("mlp_bias", False)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "init_std": cfg.get("initializer_range", 0.02),
    }
    kwargs.update(overrides)
    state = from_hf_state_dict(_load_tensors(folder), kwargs, str(folder))
    state = {k: v.float() for k, v in state.items()}
    return build_with_weights(kwargs, state, f"the weights in {folder}").train()
