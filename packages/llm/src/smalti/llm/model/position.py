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
    def tables(
        self, seq_len: int, offset: int, device: torch.device, dtype: torch.dtype, signed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[seq_len, head_dim]`` for positions ``offset .. offset + seq_len - 1``; with
        ``signed``, ``sin``'s first half negated (what :func:`apply_rotary_signed` takes)."""
        key = (seq_len, offset, device, dtype, signed)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device)
        positions = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin()
        out = (emb.cos().to(dtype), (_signed_sin(sin) if signed else sin).to(dtype))
        if len(self._cache) > 8:
            self._cache.clear()
        if device.type != "meta":
            self._cache[key] = out
        return out


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``[x2, x1]`` for ``x = [x1, x2]`` split in halves along the last dimension (one copy, no zero-filled
    gradient buffers: ``roll`` by half the width is its own kind of permutation)."""
    return torch.roll(x, x.shape[-1] // 2, dims=-1)


class _ApplyRotary(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``, as ``swap(x) * [-sin1, sin2]``.

    Why a Function: autograd's graph of ``cat([-x2, x1])`` runs a negation, a concatenation and, in backward,
    two slice gradients that each fill a zero tensor the size of ``x`` and copy into it. Here backward is the
    forward's own form, ``g * cos + swap(g * [-sin1, sin2])``: three passes over ``x``, nothing saved but the
    (cached) tables. Same bits as the plain formula in forward and backward: the sign moves into the table
    (``(-a) * b == a * (-b)``) and each output element adds the same two products.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, signed_sin)
        ctx.dtype = x.dtype
        out = x * cos
        return out.add_(_swap_halves(x) * signed_sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cos, signed_sin = ctx.saved_tensors
        # swap(g * s) placed where x's swapped copy came from: swap is its own inverse.
        out = grad * cos
        return out.add_(_swap_halves(grad * signed_sin)).to(ctx.dtype), None, None


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (half-split convention, the one Hugging Face Llama uses); ``cos``/``sin`` broadcast against
    it (``[T, D]`` for ``[B, H, T, D]``, ``[T, 1, D]`` for ``[B, T, H, D]``).

    Computes ``x * cos + [-x2, x1] * sin`` through :class:`_ApplyRotary` (fewer passes in backward, same bits);
    ``sin`` may be given already signed (``[-sin1, sin2]``, :meth:`Rotary.tables` with ``signed=True``) by
    passing ``signed_sin`` instead.
    """
    return apply_rotary_signed(x, cos, _signed_sin(sin))


def apply_rotary_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary` with ``sin``'s first half already negated (``Rotary.tables(..., signed=True)``),
    so that a layer's two rotations (queries, keys) share one signed table."""
    if x.requires_grad and torch.is_grad_enabled():
        return _ApplyRotary.apply(x, cos, signed_sin)
    return (x * cos).add_(_swap_halves(x) * signed_sin)
