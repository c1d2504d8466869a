"""The MoE computation wired through autograd over a backend of kernels (``torch`` reference or ``triton``).

Every op is an ``autograd.Function`` whose backward calls the same backend's kernels, so the backward
formulas are exercised (and gradchecked in float64) on the ``torch`` backend on any CPU:

* ``gather_mm`` (``ys = x[perm // k] @ w[e]``): ``dx`` is ``mm_scatter(dys, w^T)`` summed over the k slots,
  ``dw = wgrad(x[perm // k], dys)`` reading ``x`` in place;
* ``mm_scatter`` (``z[perm] = h @ w[e]``): ``dh = gather_mm(dz, w^T)`` with ``k = 1``,
  ``dw = wgrad(h, dz[perm])`` reading ``dz`` in place;
* ``grouped_mm``: ``da = grouped_mm(dc, w^T)``, ``dw = wgrad(a, dc)``; transposed weights are strided
  views, never copies;
* ``scatter_rows`` (weighted combine) and ``gather_rows``;
* ``glu``: fused ``act(gate) * up`` with the activation recomputed in backward.

On CPU the ``torch`` backend's expert products (forward, input and weight gradients of every op above) can
run through a caller's 2-D product: ``set_cpu_matmul(fn)`` (see :mod:`smalti.moe.cpu_matmul`).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import torch

from smalti.moe import reference
from smalti.moe.cpu_matmul import cpu_matmul, get_cpu_matmul, set_cpu_matmul
from smalti.moe.errors import MoEError

BACKENDS = ("torch", "triton")
__all__ = ["BACKENDS", "check_triton_input", "combine", "cpu_matmul", "gather_mm", "gather_rows", "get_cpu_matmul",
           "glu", "glu_mm_scatter", "grouped_mm", "kernels", "mm_scatter", "scatter_rows", "set_cpu_matmul",
           "sort_by_expert", "triton_unavailable_reason"]


def triton_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the Triton backend cannot run here, or ``None`` when it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install 'smalti-moe[triton]')"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if device is not None and device.type != "cuda":
        return (f"Triton kernels need a CUDA device and the layer is on {device}; use backend='torch' here "
                "(or set TRITON_INTERPRET=1 before importing triton to run the kernels in Triton's slow CPU "
                "interpreter)")
    if not torch.cuda.is_available():
        return "Triton kernels need a CUDA GPU and none is present; use backend='torch'"
    return None


def check_triton_input(x: torch.Tensor) -> None:
    """Raise :class:`MoEError` when the Triton kernels cannot take ``x`` (device, or a dtype they do not support)."""
    reason = triton_unavailable_reason(x.device)
    if reason:
        raise MoEError(f"backend='triton' cannot run: {reason}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise MoEError(f"backend='triton' takes float32, bfloat16 or float16 inputs, not {x.dtype}; "
                       "use backend='torch' (e.g. for float64 gradient checks)")


def kernels(backend: str) -> ModuleType:
    """The module holding ``backend``'s kernels (:mod:`smalti.moe.reference` or :mod:`smalti.moe.triton_kernels`)."""
    if backend == "torch":
        return reference
    if backend == "triton":
        reason = triton_unavailable_reason()
        if reason:
            raise MoEError(f"backend='triton' cannot run: {reason}")
        return importlib.import_module("smalti.moe.triton_kernels")
    raise MoEError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(1, 2)


class _GatherMM(torch.autograd.Function):
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
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx_entries = K.mm_scatter(dys, _t(w), perm, offsets)  # [T*k, D] in entry order
            dx = dx_entries.view(-1, k, dx_entries.shape[-1]).sum(1) if k > 1 else dx_entries
        if ctx.needs_input_grad[1]:
            index = perm if k == 1 else torch.div(perm, k, rounding_mode="floor")
            dw = K.grouped_mm_wgrad(x, dys, offsets, a_index=index)
        return dx, dw, None, None, None, None


class _MMScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h, w, perm, offsets, K) -> torch.Tensor:
        ctx.save_for_backward(h, w, perm, offsets)
        ctx.K = K
        return K.mm_scatter(h, w, perm, offsets)

    @staticmethod
    def backward(ctx: Any, dz):
        h, w, perm, offsets = ctx.saved_tensors
        K = ctx.K
        dz = dz.contiguous()
        dh = K.gather_mm(dz, _t(w), perm, offsets, 1) if ctx.needs_input_grad[0] else None
        dw = K.grouped_mm_wgrad(h, dz, offsets, dc_index=perm) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None


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
        da = K.grouped_mm(dc, _t(w), offsets) if ctx.needs_input_grad[0] else None
        dw = K.grouped_mm_wgrad(a, dc, offsets) if ctx.needs_input_grad[1] else None
        return da, dw, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, perm, k, K) -> torch.Tensor:
        ctx.save_for_backward(perm)
        ctx.k, ctx.K = k, K
        return K.gather_rows(x, perm, k)

    @staticmethod
    def backward(ctx: Any, dxs):
        (perm,) = ctx.saved_tensors
        return ctx.K.scatter_rows(dxs.contiguous(), perm, None, ctx.k), None, None, None


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
        dy_rows = K.gather_rows(dy.contiguous(), perm, k)  # each sorted row's token gradient
        flat_w = weights.reshape(-1).index_select(0, perm)
        dys = dy_rows * flat_w.unsqueeze(-1).to(dy_rows.dtype)
        dweights = None
        if ctx.needs_input_grad[2]:
            acc = torch.promote_types(ys.dtype, torch.float32)
            dw_sorted = (ys.to(acc) * dy_rows.to(acc)).sum(-1)
            dweights = torch.empty_like(dw_sorted)
            dweights[perm] = dw_sorted
            dweights = dweights.view_as(weights).to(weights.dtype)
        return dys, None, dweights, None, None


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


class _GLUMMScatter(torch.autograd.Function):
    """``mm_scatter(act(gate) * up, w)`` for packed ``h = [gate | up]`` on the ``torch`` backend: keeps only ``h``
    for backward (the GLU output, ``N x F``, is recomputed there for the weight gradient instead of held from
    forward to backward) and writes the gate and up gradients into one packed tensor (no concatenation)."""

    @staticmethod
    def forward(ctx: Any, h, w, perm, offsets, activation) -> torch.Tensor:
        ctx.save_for_backward(h, w, perm, offsets)
        ctx.activation = activation
        return reference.mm_scatter(reference.glu_packed(h, activation), w, perm, offsets)

    @staticmethod
    def backward(ctx: Any, dz):
        h, w, perm, offsets = ctx.saved_tensors
        dz = dz.contiguous()
        da = reference.gather_mm(dz, _t(w), perm, offsets, 1)
        dh, a = reference.glu_packed_backward(h, da, ctx.activation, input_grad=ctx.needs_input_grad[0])
        dw = reference.grouped_mm_wgrad(a, dz, offsets, dc_index=perm) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None


def glu_mm_scatter(h, w, perm, offsets, activation: str, backend: str) -> torch.Tensor:
    """The GLU expert's second half: ``mm_scatter(act(gate) * up, w)`` for packed ``h = [gate | up]`` (sorted rows),
    in entry order. The ``torch`` backend fuses it (:class:`_GLUMMScatter`: less memory, no concatenation in
    backward); the Triton backend runs its fused ``glu`` kernel and ``mm_scatter``."""
    if backend == "torch":
        return _GLUMMScatter.apply(h, w, perm, offsets, activation)
    gate, up = h.split(h.shape[-1] // 2, dim=-1)
    return mm_scatter(glu(gate, up, activation, backend), w, perm, offsets, backend)


def gather_mm(x, w, perm, offsets, k: int, backend: str) -> torch.Tensor:
    """Token rows times their expert's weight, in expert-sorted order ``[N, M]`` (fused gather + GEMM)."""
    return _GatherMM.apply(x, w, perm, offsets, k, kernels(backend))


def mm_scatter(h, w, perm, offsets, backend: str) -> torch.Tensor:
    """Sorted rows times their expert's weight, written back in entry order ``[N, M]`` (fused GEMM + scatter)."""
    return _MMScatter.apply(h, w, perm, offsets, kernels(backend))


def grouped_mm(a, w, offsets, backend: str) -> torch.Tensor:
    """Expert-sorted rows times their expert's weight."""
    return _GroupedMM.apply(a, w, offsets, kernels(backend))


def gather_rows(x, perm, k: int, backend: str) -> torch.Tensor:
    """Token rows copied into expert-sorted order."""
    return _GatherRows.apply(x, perm, k, kernels(backend))


def scatter_rows(ys, perm, weights, k: int, backend: str) -> torch.Tensor:
    """Weighted sum over each token's k expert outputs (given in sorted order), in token order."""
    return _ScatterRows.apply(ys, perm, weights, k, kernels(backend))


def combine(z: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_j weights[t, j] * z[t*k + j]`` for ``z`` in entry order: one ``(1 x k) @ (k x D)`` per token."""
    tokens, k = weights.shape
    if k == 1:
        return z * weights.to(z.dtype)
    return torch.bmm(weights.unsqueeze(1).to(z.dtype), z.view(tokens, k, -1)).squeeze(1)


def glu(gate, up, activation: str, backend: str) -> torch.Tensor:
    """``act(gate) * up``; the Triton backend fuses it for silu, gelu (tanh) and relu."""
    K = kernels(backend)
    if backend == "triton" and activation not in ("silu", "gelu", "relu"):
        K = reference
    return _GLU.apply(gate, up, activation, K)


def sort_by_expert(expert_ids, num_experts: int, backend: str):
    """Stable sort of expert ids: ``perm``, ``counts``, ``offsets``."""
    return kernels(backend).sort_by_expert(expert_ids, num_experts)
