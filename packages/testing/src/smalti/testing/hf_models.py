"""Tiny random Hugging Face causal LMs for tests, written by ``transformers`` itself (``save_pretrained``) with a
chat tokenizer (:func:`smalti.testing.hf_tokenizers.write_chat_tokenizer`) in the same folder. Offline.

Families: ``llama`` (Llama 2 shape), ``llama3`` (Llama 3.1 shape: ``rope_scaling`` type llama3, large theta),
``mistral`` (a sliding window of 16 positions unless overridden), ``qwen2`` (q/k/v biases) and ``qwen3`` (QK-norm,
heads of 32 wider than ``hidden_size / num_attention_heads``) and ``gemma3`` (text: a local layer with a window of
8 and its own RoPE base, then a global one; ``query_pre_attn_scalar`` apart from ``head_dim``) and ``mixtral``
(4 experts of width 48, top 2, ``output_router_logits`` on), ``qwen3_moe`` (the same experts, Qwen3's
attention, no renormalisation of the top 2), ``olmoe`` (QK-norm over whole projections) and ``qwen2_moe`` (q/k/v
biases, a shared expert of width 64 behind a sigmoid gate) and ``dbrx`` (its own config keys: LayerNorm without
bias, fused ``Wqkv`` clipped at 0.3 so that clipping bites, 4 fused experts of width 48, top 2, RoPE base 500000
in both ``rope_parameters`` and ``attn_config.rope_theta``). Every weight,
norms and biases included, is drawn at random, so that a wrong mapping of any tensor shows in the logits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: family -> (transformers config class name, tokenizer style)
FAMILIES = {
    "llama": ("LlamaConfig", "llama3"),
    "llama3": ("LlamaConfig", "llama3"),
    "mistral": ("MistralConfig", "mistral"),
    "qwen2": ("Qwen2Config", "chatml"),
    "qwen3": ("Qwen3Config", "chatml"),
    "gemma3": ("Gemma3TextConfig", "chatml"),
    "mixtral": ("MixtralConfig", "mistral"),
    "qwen3_moe": ("Qwen3MoeConfig", "chatml"),
    "olmoe": ("OlmoeConfig", "chatml"),
    "qwen2_moe": ("Qwen2MoeConfig", "chatml"),
    "dbrx": ("DbrxConfig", "chatml"),
}
#: token named by each config id, per tokenizer style
_TOKENS = {
    "llama3": {"bos_token_id": "<|begin_of_text|>", "eos_token_id": "<|eot_id|>"},
    "mistral": {"bos_token_id": "<s>", "eos_token_id": "</s>"},
    "chatml": {"eos_token_id": "<|im_end|>", "pad_token_id": "<|endoftext|>"},
}


def tiny_config(family: str, vocab_size: int = 512, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of a tiny ``family`` config (GQA: 4 query heads, 2 key/value heads)."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: choose one of {', '.join(FAMILIES)}")
    if family == "dbrx":
        return _tiny_dbrx_config(vocab_size, **overrides)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    if family == "llama3":
        kwargs.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if family == "mistral":
        kwargs["sliding_window"] = 16
    if family == "qwen3":
        kwargs["head_dim"] = 32  # wider than 64 / 4, as Qwen3's 128 is wider than most of its widths allow
    if family == "gemma3":
        kwargs.update(head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"],
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    moe = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.02}
    if family == "mixtral":  # 4 experts, top 2; the loss is added, as output_router_logits asks
        kwargs.update(intermediate_size=48, num_local_experts=4, **moe)
    if family == "qwen3_moe":
        kwargs.update(head_dim=32, moe_intermediate_size=48, num_experts=4, norm_topk_prob=False, **moe)
    if family == "olmoe":
        kwargs.update(intermediate_size=48, num_experts=4, norm_topk_prob=False, **moe)
    if family == "qwen2_moe":
        kwargs.update(moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=4, **moe)
    kwargs.update(overrides)
    return kwargs


def _tiny_dbrx_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """DBRX's keys (``d_model``, ``attn_config``, ``ffn_config``) for the same tiny shape as the other MoE ones;
    ``overrides`` of ``attn_config`` / ``ffn_config`` update those dicts."""
    attn = {"kv_n_heads": 2, "clip_qkv": 0.3, "rope_theta": 500000.0, **overrides.pop("attn_config", {})}
    ffn = {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2, "moe_loss_weight": 0.02,
           **overrides.pop("ffn_config", {})}
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, d_model=64, n_heads=4, n_layers=2, max_seq_len=256, attn_config=attn, ffn_config=ffn,
        output_router_logits=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": attn["rope_theta"]},
    )
    kwargs.update(overrides)
    return kwargs


def write_tiny_hf_model(folder: str | os.PathLike, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random ``family`` model and its chat tokenizer into ``folder``; returns the folder.

    ``overrides`` replace config arguments (``tie_word_embeddings=True``, ``num_key_value_heads=1``,
    ``sliding_window=8``, ...). The same arguments always write the same weights.
    """
    import tokenizers
    import torch
    import transformers

    from smalti.testing.hf_tokenizers import write_chat_tokenizer

    folder = Path(folder)
    config_name, style = FAMILIES[family]
    write_chat_tokenizer(folder, style)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {key: tok.token_to_id(token) for key, token in _TOKENS[style].items()}
    kwargs = tiny_config(family, vocab_size=tok.get_vocab_size(with_added_tokens=True), **{**ids, **overrides})
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers starts biases at zero and norms at one: make every tensor count
        for name, p in model.named_parameters():
            is_norm = "norm" in name.rsplit(".", 2)[-2]  # the module's own name (DBRX nests attn in norm_attn_norm)
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if is_norm else 0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder
