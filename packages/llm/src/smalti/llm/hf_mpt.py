"""MPT-style models (the ``mpt_*`` recipes) as Hugging Face folders that ``transformers`` loads natively.

An MPT-style :class:`~smalti.llm.LLM` (LayerNorm, GELU MLP, one key/value head per query head, no QK-norm,
no sliding window) maps onto one of two classes that ship with ``transformers`` (no ``trust_remote_code``):

* ALiBi positions: ``MptForCausalLM`` (``model_type: mpt``; its norms have no bias, so the model must have
  ``bias: false``, as LLM Foundry's MPT recipes do);
* learned positions (what LLM Foundry's ``mpt-*`` pretraining recipes, and so smalti's, use): ``GPT2LMHeadModel``
  (``model_type: gpt2``; the MPT port in ``transformers`` always adds ALiBi and has no position table). Missing
  biases are written as zeros, GELU is the exact one (``activation_function: gelu``).

:func:`export_mpt` writes the folder (weights as one safetensors file, ``config.json``,
``generation_config.json``, and the tokenizer with ``tokenizer_config.json`` and its special tokens, so that
``AutoTokenizer`` and lm-evaluation-harness load it); :func:`import_mpt` reads such a folder back into an
:class:`LLM`, so a round trip is exact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from smalti.llm.errors import ConversionError
from smalti.llm.model.transformer import LLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mpt_family(model_or_config: Any) -> str:
    """``"mpt"`` or ``"gpt2"``: the ``transformers`` family an MPT-style model (or its ``config`` dict) exports
    to; raises :class:`ConversionError` naming what does not fit when it is not MPT-shaped."""
    c = model_or_config if isinstance(model_or_config, dict) else model_or_config.config
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
    if c.get("softmax_scale") not in (None, (c["d_model"] // c["n_heads"]) ** -0.5):
        why.append(f"softmax_scale={c.get('softmax_scale')}")
    position = c.get("position")
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
        family = ""
    if why:
        raise ConversionError("not exportable as a Hugging Face MPT or GPT-2 model: " + "; ".join(why))
    return family


def is_mpt_like(model: LLM) -> bool:
    """Whether :func:`export_mpt` can write ``model``."""
    try:
        mpt_family(model)
    except ConversionError:
        return False
    return True


def hf_config(model: Any, dtype: str = "float32", eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``model`` as ``MptForCausalLM`` or ``GPT2LMHeadModel``."""
    c = model.config
    family = mpt_family(model)
    common = {"vocab_size": c["vocab_size"], "layer_norm_epsilon": c["norm_eps"], "torch_dtype": dtype,
              "tie_word_embeddings": bool(c["tie_embeddings"]), "use_cache": True,
              "bos_token_id": eos_token_id, "eos_token_id": eos_token_id}
    if family == "mpt":
        return {**common, "architectures": ["MptForCausalLM"], "model_type": "mpt", "d_model": c["d_model"],
                "n_heads": c["n_heads"], "n_layers": c["n_layers"], "max_seq_len": c["max_seq_len"],
                "expansion_ratio": c["ffn_hidden_size"] // c["d_model"], "no_bias": True, "learned_pos_emb": False,
                "norm_type": "low_precision_layernorm", "resid_pdrop": 0.0, "emb_pdrop": 0.0,
                "attn_config": {"alibi": True, "alibi_bias_max": int(c["alibi_bias_max"]), "clip_qkv": c["clip_qkv"],
                                "softmax_scale": c["softmax_scale"], "attn_pdrop": 0, "qk_ln": False}}
    return {**common, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": c["d_model"],
            "n_head": c["n_heads"], "n_layer": c["n_layers"], "n_positions": c["max_seq_len"],
            "n_inner": c["ffn_hidden_size"], "activation_function": "gelu", "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def _gpt2_names(n_layers: int) -> list[tuple[str, str, bool]]:
    """``(smalti name, GPT-2 name, transposed)`` per tensor; GPT-2's Conv1D stores weights as ``[in, out]``."""
    names = [("wte.weight", "transformer.wte.weight", False), ("wpe.weight", "transformer.wpe.weight", False)]
    for i in range(n_layers):
        s, h = f"blocks.{i}", f"transformer.h.{i}"
        for ours, theirs, t in (("norm_1", "ln_1", False), ("attn.wqkv", "attn.c_attn", True),
                                ("attn.out_proj", "attn.c_proj", True), ("norm_2", "ln_2", False),
                                ("ffn.up_proj", "mlp.c_fc", True), ("ffn.down_proj", "mlp.c_proj", True)):
            names += [(f"{s}.{ours}.weight", f"{h}.{theirs}.weight", t), (f"{s}.{ours}.bias", f"{h}.{theirs}.bias", False)]
    names += [("norm_f.weight", "transformer.ln_f.weight", False), ("norm_f.bias", "transformer.ln_f.bias", False),
              ("lm_head.weight", "lm_head.weight", False)]
    return names


def _mpt_names(n_layers: int) -> list[tuple[str, str, bool]]:
    names = [("wte.weight", "transformer.wte.weight", False)]
    for i in range(n_layers):
        s, h = f"blocks.{i}", f"transformer.blocks.{i}"
        for part in ("norm_1", "attn.out_proj", "norm_2", "ffn.up_proj", "ffn.down_proj"):
            names.append((f"{s}.{part}.weight", f"{h}.{part}.weight", False))
        names.append((f"{s}.attn.wqkv.weight", f"{h}.attn.Wqkv.weight", False))
    names += [("norm_f.weight", "transformer.norm_f.weight", False), ("lm_head.weight", "lm_head.weight", False)]
    return names


def _names(family: str, n_layers: int) -> list[tuple[str, str, bool]]:
    return _mpt_names(n_layers) if family == "mpt" else _gpt2_names(n_layers)


def to_hf_state_dict(model: Any, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``model``'s weights (or ``state``, under smalti's names) under the Hugging Face family's names."""
    family = mpt_family(model)
    state = state if state is not None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out = {}
    for ours, theirs, transposed in _names(family, model.config["n_layers"]):
        if ours == "lm_head.weight" and model.config["tie_embeddings"]:
            continue
        tensor = state.get(ours)
        if tensor is None:
            if not ours.endswith(".bias"):
                raise ConversionError(f"the model has no {ours!r} to export")
            weight = state[ours.removesuffix(".bias") + ".weight"]
            tensor = torch.zeros(weight.shape[0], dtype=weight.dtype)  # GPT-2 always has biases
        out[theirs] = (tensor.t() if transposed else tensor).contiguous()
    return out


def export_mpt(model: Any, folder: str | os.PathLike, dtype: str | None = None, tokenizer: Any = "default",
               state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` (unsharded; ``state``: its full state dict when it is sharded) to ``folder`` as a
    ``transformers`` MPT (ALiBi) or GPT-2 (learned positions) folder; returns the folder."""
    from safetensors.torch import save_file

    dtype = dtype or "float32"
    if dtype not in _DTYPES:
        raise ConversionError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    eos = None
    if tokenizer is not None:
        eos = write_tokenizer_files(tokenizer, folder)
    tensors = {k: v.to(_DTYPES[dtype]).contiguous() for k, v in to_hf_state_dict(model, state).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(model, dtype, eos)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos} if eos is not None else {}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder


def write_tokenizer_files(tokenizer: Any, folder: Path) -> int | None:
    """``tokenizer.json`` plus ``tokenizer_config.json`` and ``special_tokens_map.json`` naming its end-of-text
    (and padding) token, so ``AutoTokenizer`` and lm-evaluation-harness load the folder; returns the EOS id."""
    import shutil

    from smalti.llm.tokenizer import BPETokenizer, load_tokenizer

    tok = load_tokenizer(tokenizer)
    if not isinstance(tok, BPETokenizer):
        return getattr(tok, "eos_id", None)
    shutil.copyfile(tok.path, folder / "tokenizer.json")
    eos = tok._tok.id_to_token(tok.eos_id)
    pad = tok._tok.id_to_token(tok.pad_id)
    special = {"bos_token": eos, "eos_token": eos, "unk_token": eos, "pad_token": pad}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000_000,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tok.eos_id


def import_mpt(folder: str | os.PathLike) -> LLM:
    """An :class:`LLM` (CPU, eval mode) with the weights of a folder :func:`export_mpt` wrote, or any local
    ``transformers`` MPT (ALiBi, no biases) or GPT-2 folder whose shape smalti has."""
    from safetensors.torch import load_file

    from smalti.llm.export import build_with_weights

    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{folder / 'config.json'}: {exc}") from exc
    model_type = cfg.get("model_type")
    if model_type == "mpt":
        attn = cfg.get("attn_config") or {}
        config = {"d_model": cfg["d_model"], "n_heads": cfg["n_heads"], "n_layers": cfg["n_layers"],
                  "vocab_size": cfg["vocab_size"], "max_seq_len": cfg["max_seq_len"],
                  "ffn_hidden_size": int(cfg["d_model"] * cfg["expansion_ratio"]), "position": "alibi",
                  "alibi_bias_max": attn.get("alibi_bias_max", 8), "clip_qkv": attn.get("clip_qkv"),
                  "softmax_scale": attn.get("softmax_scale"), "bias": False}
    elif model_type == "gpt2":
        if cfg.get("activation_function") != "gelu":
            raise ConversionError(f"{folder}: activation_function={cfg.get('activation_function')!r}; smalti's "
                                  "MPT-style models use the exact GELU ('gelu')")
        config = {"d_model": cfg["n_embd"], "n_heads": cfg["n_head"], "n_layers": cfg["n_layer"],
                  "vocab_size": cfg["vocab_size"], "max_seq_len": cfg["n_positions"],
                  "ffn_hidden_size": cfg.get("n_inner") or 4 * cfg["n_embd"], "position": "learned", "bias": True}
    else:
        raise ConversionError(f"{folder}: model_type={model_type!r} is not mpt or gpt2")
    config.update({"norm_type": "layernorm", "norm_eps": cfg.get("layer_norm_epsilon", 1e-5), "ffn_type": "mlp",
                   "activation": "gelu", "tie_embeddings": cfg.get("tie_word_embeddings", True)})
    hf = load_file(str(folder / "model.safetensors"))
    state = {}
    for ours, theirs, transposed in _names(model_type, config["n_layers"]):
        if theirs not in hf:
            if ours == "lm_head.weight" and config["tie_embeddings"]:
                continue
            raise ConversionError(f"{folder / 'model.safetensors'} has no {theirs!r}")
        state[ours] = (hf[theirs].t() if transposed else hf[theirs]).float().contiguous()
    return build_with_weights(config, state, str(folder / "model.safetensors"))
