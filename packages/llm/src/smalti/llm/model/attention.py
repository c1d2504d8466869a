"""Causal self-attention through PyTorch SDPA: grouped-query heads, optional QK-norm, RoPE or ALiBi,
sequence-id masking for packed documents, sliding windows, and Ulysses sequence parallelism.

The model describes its mask with :class:`~smalti.llm.model.attention_mask.AttentionMask` and attention runs
in tiles whose memory is linear in the sequence (:func:`~smalti.llm.model.attention_mask.attend`).
:func:`build_attention_mask` materialises the same mask densely: it is the reference the tests compare with.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smalti.core.cpu_gemm import Linear
from smalti.llm.model.attention_mask import AttentionMask, attend
from smalti.llm.model.norms import make_norm
from smalti.llm.model.position import Rotary, alibi_bias, apply_rotary_signed
from smalti.llm.model.sequence_parallel import SequenceParallelGroup, heads_to_sequence, sequence_to_heads


def build_attention_mask(
    seq_len: int,
    device: torch.device,
    sequence_id: torch.Tensor | None = None,
    slopes: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor | None:
    """The dense SDPA mask for one forward pass, or ``None`` when plain causal attention suffices (memory
    quadratic in ``seq_len``: the reference for :class:`AttentionMask`, which the model uses).

    Boolean ``[B|1, 1, T, T]`` when only documents are masked (``sequence_id``) or a sliding ``window`` limits
    each query to itself and the ``window - 1`` positions before it (Mistral's rule: key ``j`` is seen by
    query ``i`` when ``i - window < j <= i``); float ``[B|1, H, T, T]`` (``-inf`` where masked) when ALiBi
    ``slopes`` add a bias.
    """
    window = window if window is not None and window < seq_len else None  # a window as long as T masks nothing
    if sequence_id is None and slopes is None and window is None:
        return None
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if window is not None:
        allowed = allowed.triu(-(window - 1))
    allowed = allowed[None, None]
    if sequence_id is not None:
        allowed = allowed & (sequence_id[:, None, :, None] == sequence_id[:, None, None, :])
    if slopes is None:
        return allowed
    bias = alibi_bias(slopes, seq_len, device, torch.float32)
    return bias.masked_fill(~allowed, float("-inf"))


class Attention(nn.Module):
    """Multi-head, grouped-query (``n_kv_heads < n_heads``) or multi-query causal self-attention."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        bias: bool = False,
        qk_norm: bool = False,
        norm_type: str = "rmsnorm",
        norm_eps: float = 1e-5,
        rotary: Rotary | None = None,
        softmax_scale: float | None = None,
        clip_qkv: float | None = None,
        device: Any = None,
        qkv_bias: bool | None = None,
        head_dim: int | None = None,
        qk_norm_scope: str = "head",
    ) -> None:
        super().__init__()
        if qk_norm_scope not in ("head", "all"):
            raise ValueError(f"qk_norm_scope={qk_norm_scope!r} must be 'head' or 'all'")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        # ``head_dim`` (default ``d_model // n_heads``) apart from d_model: Qwen3 and Gemma widen the heads.
        self.head_dim = head_dim or d_model // n_heads
        self.softmax_scale = softmax_scale
        self.clip_qkv = clip_qkv
        self.rotary = rotary
        # ``qkv_bias`` (default ``bias``) for the query/key/value projection alone: Qwen2 has it, no output bias.
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.wqkv = Linear(d_model, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=qkv_bias, device=device)
        self.out_proj = Linear(n_heads * self.head_dim, d_model, bias=bias, device=device)
        self.out_proj._is_residual = True  # type: ignore[attr-defined]
        # QK-norm per head (Qwen3) or over the whole query / key projection (OLMo, OLMoE: ``qk_norm_scope='all'``)
        self.qk_norm_scope = qk_norm_scope
        q_width, k_width = (self.head_dim, self.head_dim) if qk_norm_scope == "head" else (
            n_heads * self.head_dim, n_kv_heads * self.head_dim)
        self.q_norm = make_norm(norm_type, q_width, norm_eps, bias, device) if qk_norm else None
        self.k_norm = make_norm(norm_type, k_width, norm_eps, bias, device) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask | torch.Tensor | None = None,
        sp: SequenceParallelGroup | None = None,
    ) -> torch.Tensor:
        """Attend over ``x [B, T, d_model]``.

        ``mask``: an :class:`AttentionMask` (memory linear in ``T``), a dense SDPA mask (the reference), or
        ``None`` for plain causal attention. With ``sp``, ``x`` is this rank's chunk of ``T / sp.size``
        positions; queries, keys and values are exchanged so that each rank attends over the whole sequence
        with ``n_heads / sp.size`` heads, and ``mask`` covers the whole sequence and (for ALiBi) only those heads.
        """
        b, t, _ = x.shape
        qkv = self.wqkv(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        hd = self.head_dim
        q, k, v = qkv.split([self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], dim=-1)
        if self.q_norm is not None and self.qk_norm_scope == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.n_heads, hd)
        k = k.view(b, t, self.n_kv_heads, hd)
        v = v.view(b, t, self.n_kv_heads, hd)
        if self.q_norm is not None and self.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            offset = sp.rank * t if sp is not None else 0  # this chunk's first position in the sequence
            # Under autocast the projections come out in bf16: rotate in fp32 with fp32 tables and round once
            # (as transformers' Llama under autocast does), not with bf16 tables and bf16 products.
            amp = torch.is_autocast_enabled(q.device.type) and q.dtype != torch.float32
            cos, sin = self.rotary.tables(t, offset, q.device, torch.float32 if amp else q.dtype, signed=True)
            cos, sin = cos[:, None], sin[:, None]  # broadcast over heads: [T, 1, D]
            dtype = q.dtype
            q, k = apply_rotary_signed(q, cos, sin), apply_rotary_signed(k, cos, sin)
            if amp:
                q, k = q.to(dtype), k.to(dtype)
        if sp is not None:
            if self.n_kv_heads % sp.size:
                # Too few key/value heads to split: give every query head its own copy.
                groups = self.n_heads // self.n_kv_heads
                k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
            q, k, v = sequence_to_heads(q, sp), sequence_to_heads(k, sp), sequence_to_heads(v, sp)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # PyTorch's CPU bf16 attention kernel alone moves a Llama's first loss by ~1.4e-4 relative from fp32
        # (measured at 128k vocabulary, seq 2048); attention is a small share of the step's FLOPs, so under CPU
        # autocast it runs in fp32 and only the matrix products of the projections, MLP and head use bf16.
        cpu_amp = q.device.type == "cpu" and q.dtype != torch.float32 and torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", enabled=False) if cpu_amp else contextlib.nullcontext():
            if cpu_amp:
                q, k, v = q.float(), k.float(), v.float()
            if isinstance(mask, torch.Tensor):
                if mask.dtype != torch.bool:
                    mask = mask.to(q.dtype)
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
                )
            else:
                out = attend(q, k, v, mask, self.softmax_scale)
        out = out.transpose(1, 2)
        if sp is not None:
            out = heads_to_sequence(out, sp)
        return self.out_proj(out.reshape(b, t, -1))
