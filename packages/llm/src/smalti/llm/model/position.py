"""Position information: ALiBi slopes and biases, rotary embeddings (RoPE) with linear or Llama-3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from smalti.llm.errors import ModelConfigError


def alibi_slopes(n_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """Per-head ALiBi slopes ``2^(-alibi_bias_max * i / n)``; for non-power-of-two head counts the slopes of
    the next power of two are interleaved (even ones first), as in the ALiBi paper's reference."""
    n = 2 ** math.ceil(math.log2(n_heads))
    slopes = torch.tensor([2.0 ** (-alibi_bias_max * (i + 1) / n) for i in range(n)])
    if n != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes


def alibi_bias(slopes: torch.Tensor, seq_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi bias ``[1, H, T, T]``: ``slope * (j - i)`` (0 on the diagonal, more negative further back)."""
    pos = torch.arange(seq_len, device=device)
    rel = (pos[None, :] - pos[:, None]).to(dtype)  # j - i
    return (slopes.to(device=device, dtype=dtype)[:, None, None] * rel[None]).unsqueeze(0)


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, after the optional ``scaling`` (``type``: linear, llama3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ModelConfigError(f"model.rope_scaling.type={kind!r} is not one of linear, llama3")


class Rotary:
    """Cos/sin tables for rotary embeddings, cached per (length, device, dtype); no parameters or buffers,
    so the module works unchanged on the meta device and under FSDP."""

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: dict[str, Any] | None = None) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling) if scaling else None
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    # Eager under torch.compile: traced, the cache lookup would guard on the cache's contents and recompile the
    # block once the first call has filled it.
    @torch.compiler.disable
    def tables(self, seq_len: int, offset: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[seq_len, head_dim]`` for positions ``offset .. offset + seq_len - 1``."""
        key = (seq_len, offset, device, dtype)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device)
        positions = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        out = (emb.cos().to(dtype), emb.sin().to(dtype))
        if len(self._cache) > 8:
            self._cache.clear()
        if device.type != "meta":
            self._cache[key] = out
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (half-split convention, the one Hugging Face Llama uses); ``cos``/``sin`` broadcast against
    it (``[T, D]`` for ``[B, H, T, D]``, ``[T, 1, D]`` for ``[B, T, H, D]``)."""
    return x * cos + _rotate_half(x) * sin
