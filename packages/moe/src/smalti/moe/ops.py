"""The MoE computation wired through autograd, over a backend of kernels (``torch`` reference or ``triton``).

The ``torch`` backend relies on autograd through the reference ops. The ``triton`` backend uses
``autograd.Function`` s whose backward passes call the Triton kernels too: grouped GEMM backward is a
grouped GEMM with transposed weights (input gradient) and ``grouped_mm_wgrad`` (weight gradient).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import torch

from smalti.moe import reference
from smalti.moe.errors import MoEError

BACKENDS = ("torch", "triton")


def triton_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the Triton backend cannot run here, or ``None`` when it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install 'smalti-moe[triton]')"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if device is not None and device.type != "cuda":
        return (f"Triton kernels need a CUDA device and the tensors are on {device}; use backend='torch' here "
                "(or TRITON_INTERPRET=1 to run the kernels in Triton's slow CPU interpreter)")
    if not torch.cuda.is_available():
        return "Triton kernels need a CUDA GPU and none is present; use backend='torch'"
    return None


def kernels(backend: str) -> ModuleType:
    """The module holding ``backend``'s kernels."""
    if backend == "torch":
        return reference
    if backend == "triton":
        reason = triton_unavailable_reason()
        if reason:
            raise MoEError(f"backend='triton' cannot run: {reason}")
        return importlib.import_module("smalti.moe.triton_kernels")
    raise MoEError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")


class _GatherMM(torch.autograd.Function):
    """``ys = gather(x, perm // k) @ w[expert]`` fused; backward: scatter of grouped ``dys @ w^T`` and wgrad."""

    @staticmethod
    def forward(ctx: Any, x, w, perm, offsets, k, K) -> torch.Tensor:
        ctx.save_for_backward(x, w, perm, offsets)
        ctx.k, ctx.K = k, K
        return K.gather_mm(x, w, perm, offsets, k)

    @staticmethod
    def backward(ctx: Any, dys):
        x, w, perm, offsets = ctx.saved_tensors
        K, k = ctx.K, ctx.k
        dys = dys.contiguous()
        dxs = K.grouped_mm(dys, w.transpose(1, 2).contiguous(), offsets)
        dx = K.scatter_rows(dxs, perm, None, k)
        dw = K.grouped_mm_wgrad(K.gather_rows(x, perm, k), dys, offsets)
        return dx, dw, None, None, None, None


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a, w, offsets, K) -> torch.Tensor:
        ctx.save_for_backward(a, w, offsets)
        ctx.K = K
        return K.grouped_mm(a, w, offsets)

    @staticmethod
    def backward(ctx: Any, dc):
        a, w, offsets = ctx.saved_tensors
        K = ctx.K
        dc = dc.contiguous()
        return K.grouped_mm(dc, w.transpose(1, 2).contiguous(), offsets), K.grouped_mm_wgrad(a, dc, offsets), None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ys, perm, weights, k, K) -> torch.Tensor:
        ctx.save_for_backward(ys, perm, weights)
        ctx.k, ctx.K = k, K
        return K.scatter_rows(ys, perm, weights, k)

    @staticmethod
    def backward(ctx: Any, dy):
        ys, perm, weights = ctx.saved_tensors
        k, K = ctx.k, ctx.K
        dy = dy.contiguous()
        dy_rows = K.gather_rows(dy, perm, k)  # dy of each entry's token, in sorted order
        flat_w = weights.reshape(-1).index_select(0, perm)
        dys = dy_rows * flat_w.unsqueeze(-1).to(dy_rows.dtype)
        dw_sorted = (ys.float() * dy_rows.float()).sum(-1)
        dweights = torch.empty_like(dw_sorted)
        dweights[perm] = dw_sorted
        return dys, None, dweights.view_as(weights).to(weights.dtype), None, None


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate, up, activation, K) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.activation, ctx.K = activation, K
        return K.glu(gate, up, activation)

    @staticmethod
    def backward(ctx: Any, dout):
        gate, up = ctx.saved_tensors
        dg, du = ctx.K.glu_backward(gate, up, dout.contiguous(), ctx.activation)
        return dg, du, None, None


def gather_mm(x, w, perm, offsets, k, backend: str) -> torch.Tensor:
    """Tokens' rows times their expert's weight, in expert-sorted order ``[N, M]``."""
    K = kernels(backend)
    if backend == "torch":
        return K.gather_mm(x, w, perm, offsets, k)
    return _GatherMM.apply(x.contiguous(), w, perm, offsets, k, K)


def grouped_mm(a, w, offsets, backend: str) -> torch.Tensor:
    """Expert-sorted rows times their expert's weight."""
    K = kernels(backend)
    if backend == "torch":
        return K.grouped_mm(a, w, offsets)
    return _GroupedMM.apply(a.contiguous(), w, offsets, K)


def scatter_rows(ys, perm, weights, k, backend: str) -> torch.Tensor:
    """Weighted sum over each token's k expert outputs, in token order."""
    K = kernels(backend)
    if backend == "torch":
        return K.scatter_rows(ys, perm, weights, k)
    return _ScatterRows.apply(ys.contiguous(), perm, weights.contiguous(), k, K)


def glu(gate, up, activation: str, backend: str) -> torch.Tensor:
    """``act(gate) * up``, fused on the Triton backend."""
    K = kernels(backend)
    if backend == "torch" or activation not in ("silu", "gelu", "relu"):
        return reference.glu(gate, up, activation)
    return _GLU.apply(gate.contiguous(), up.contiguous(), activation, K)


def sort_by_expert(expert_ids, num_experts: int, backend: str):
    """Stable sort of expert ids: ``perm``, ``counts``, ``offsets``."""
    return kernels(backend).sort_by_expert(expert_ids, num_experts)
