"""Plain PyTorch versions of every MoE kernel: the CPU path and the oracle the Triton kernels are tested against.

Shapes: ``T`` tokens, ``k`` experts per token, ``N = T * k`` (token, slot) entries, ``E`` experts, ``D``
hidden size. Entry ``n`` is token ``n // k``, slot ``n % k``. Sorting is by expert, stable, so entries of
one expert keep token order. Each function here has a Triton twin in :mod:`smalti.moe.triton_kernels`
with the same signature; all are differentiable through ordinary autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort of the flat expert ids ``[N]``.

    Returns ``perm`` (``perm[i]`` is the entry at sorted position ``i``), ``counts[E]`` and ``offsets[E]``
    (exclusive end of each expert's run, i.e. the inclusive cumulative sum of ``counts``).
    """
    flat = expert_ids.reshape(-1)
    perm = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, 0)
    return perm, counts, offsets


def gather_rows(x: torch.Tensor, perm: torch.Tensor, k: int) -> torch.Tensor:
    """``xs[i] = x[perm[i] // k]``: token rows copied into expert order, ``[N, D]``."""
    return x.index_select(0, torch.div(perm, k, rounding_mode="floor"))


def scatter_rows(ys: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    """``y[t] = sum_j w[t, j] * ys[pos(t*k + j)]``: back to token order, weighted sum over the k slots.

    ``weights`` is ``[T, k]`` (or ``None`` for an unweighted sum). No scatter-add: the inverse permutation
    puts rows back in entry order, then a reshape sums the k slots.
    """
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    entries = ys.index_select(0, inverse)  # entry order: [T*k, D]
    entries = entries.view(-1, k, ys.shape[-1])
    if weights is None:
        return entries.sum(1)
    return (entries * weights.unsqueeze(-1).to(entries.dtype)).sum(1)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``c[rows of e] = a[rows of e] @ b[e]`` for rows sorted by expert; ``a [N, K]``, ``b [E, K, M]`` -> ``[N, M]``."""
    bounds = [0, *offsets.tolist()]
    chunks = [a[s:e] @ b[i] for i, (s, e) in enumerate(zip(bounds, bounds[1:])) if e > s]
    return torch.cat(chunks) if chunks else a.new_zeros(0, b.shape[-1])


def grouped_mm_wgrad(a: torch.Tensor, dc: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The weight gradient of :func:`grouped_mm`: ``db[e] = a[rows of e]^T @ dc[rows of e]``, ``[E, K, M]``."""
    out = a.new_zeros(offsets.numel(), a.shape[1], dc.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[e] = a[start:end].t() @ dc[start:end]
        start = end
    return out


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_exact": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
}


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The GLU activation ``act(gate) * up`` (SwiGLU for ``silu``)."""
    return ACTIVATIONS[activation](gate) * up


def gather_mm(x: torch.Tensor, w: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, k: int) -> torch.Tensor:
    """Fused gather + grouped GEMM (ScatterMoE's ``grouped_out``): ``ys[i] = x[perm[i] // k] @ w[expert of i]``."""
    return grouped_mm(gather_rows(x, perm, k), w, offsets)
