"""Triton kernels for the MoE layer, each with the signature of its twin in :mod:`smalti.moe.reference`.

Written for both a GPU and Triton's CPU interpreter (``TRITON_INTERPRET=1``), which the tests use:
one config per kernel (the interpreter cannot autotune several), tiles of at least 16, and an fp32 upcast
before ``tl.dot`` when interpreting (the interpreter multiplies bf16 bit patterns as integers).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_BLOCK_N = 128
_BLOCK = 32


def _next_pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------------------------- sort


@triton.jit
def _sort_kernel(ids_ptr, perm_ptr, pos_ptr, counts_ptr, n, num_experts,
                 BLOCK: tl.constexpr, EP: tl.constexpr):
    experts = tl.arange(0, EP)
    counts = tl.zeros([EP], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        counts += tl.sum(onehot, axis=0)
    tl.store(counts_ptr + experts, counts, mask=experts < num_experts)
    first = tl.cumsum(counts, axis=0) - counts  # where each expert's run starts
    seen = tl.zeros([EP], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot  # earlier entries of the same expert in this block
        pos = tl.sum(onehot * (first + seen)[None, :] + onehot * rank, axis=1)
        tl.store(pos_ptr + offs, pos, mask=valid)
        tl.store(perm_ptr + pos, offs, mask=valid)
        seen += tl.sum(onehot, axis=0)


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable counting sort of expert ids in one Triton program; see :func:`reference.sort_by_expert`."""
    flat = expert_ids.reshape(-1).to(torch.int32).contiguous()
    n = flat.numel()
    perm = torch.empty(n, dtype=torch.int32, device=flat.device)
    pos = torch.empty_like(perm)
    counts = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    _sort_kernel[(1,)](flat, perm, pos, counts, n, num_experts, BLOCK=_BLOCK_N, EP=_next_pow2(num_experts))
    return perm.long(), counts.long(), torch.cumsum(counts.long(), 0)


# ----------------------------------------------------------------------------------------------- gather / scatter


@triton.jit
def _gather_kernel(x_ptr, idx_ptr, out_ptr, n, d, k, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < n
    src = tl.load(idx_ptr + rows, mask=rmask, other=0) // k
    mask = rmask[:, None] & (cols[None, :] < d)
    vals = tl.load(x_ptr + src[:, None] * d + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * d + cols[None, :], vals, mask=mask)


def gather_rows(x: torch.Tensor, perm: torch.Tensor, k: int) -> torch.Tensor:
    """``xs[i] = x[perm[i] // k]``."""
    x = x.contiguous()
    n, d = perm.numel(), x.shape[1]
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n:
        grid = (triton.cdiv(n, _BLOCK), triton.cdiv(d, _BLOCK))
        _gather_kernel[grid](x, perm.contiguous(), out, n, d, k, BLOCK_M=_BLOCK, BLOCK_D=_BLOCK)
    return out


@triton.jit
def _scatter_kernel(ys_ptr, inv_ptr, w_ptr, out_ptr, t, d, k, HAS_W: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = tokens < t
    mask = tmask[:, None] & (cols[None, :] < d)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(0, k):
        src = tl.load(inv_ptr + tokens * k + j, mask=tmask, other=0)
        vals = tl.load(ys_ptr + src[:, None] * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + tokens * k + j, mask=tmask, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += vals
    tl.store(out_ptr + tokens[:, None] * d + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inverse[perm[i]] = i``: the sorted position of each entry."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inverse


def scatter_rows(ys: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    """Weighted sum over the k slots back in token order; each output row is written once (no atomics)."""
    n, d = ys.shape
    t = n // k
    out = torch.empty(t, d, dtype=ys.dtype, device=ys.device)
    if t:
        w = weights.contiguous() if weights is not None else ys
        grid = (triton.cdiv(t, _BLOCK), triton.cdiv(d, _BLOCK))
        _scatter_kernel[grid](ys.contiguous(), inverse_permutation(perm), w, out, t, d, k,
                              HAS_W=weights is not None, BLOCK_M=_BLOCK, BLOCK_D=_BLOCK)
    return out


# ----------------------------------------------------------------------------------------------- grouped GEMM


@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, row_expert_ptr, src_ptr, n, kdim, m, gather_k,
                       GATHER: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n
    cmask = cols < m
    row_e = tl.load(row_expert_ptr + rows, mask=rmask, other=-1)
    if GATHER:
        src = tl.load(src_ptr + rows, mask=rmask, other=0) // gather_k
    else:
        src = rows
    e_lo = tl.min(tl.where(rmask, row_e, 2147483647), axis=0)
    e_hi = tl.max(row_e, axis=0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for e in range(e_lo, e_hi + 1):
        in_e = rmask & (row_e == e)
        for k0 in range(0, kdim, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < kdim
            a = tl.load(a_ptr + src[:, None] * kdim + ks[None, :], mask=in_e[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptr + e * kdim * m + ks[:, None] * m + cols[None, :],
                        mask=kmask[:, None] & cmask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
    tl.store(c_ptr + rows[:, None] * m + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


def _row_experts(offsets: torch.Tensor, n: int) -> torch.Tensor:
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return torch.repeat_interleave(torch.arange(offsets.numel(), device=offsets.device, dtype=torch.int32), counts,
                                   output_size=n)


def _launch_grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, n: int, src: torch.Tensor | None,
                    gather_k: int) -> torch.Tensor:
    kdim, m = b.shape[1], b.shape[2]
    out = torch.empty(n, m, dtype=a.dtype, device=a.device)
    if n == 0:
        return out
    grid = (triton.cdiv(n, _BLOCK), triton.cdiv(m, _BLOCK))
    upcast = INTERPRET or a.dtype == torch.float32
    _grouped_mm_kernel[grid](
        a.contiguous(), b.contiguous(), out, _row_experts(offsets, n), src if src is not None else out, n, kdim, m,
        gather_k, GATHER=src is not None, UPCAST=upcast, IEEE=a.dtype == torch.float32,
        BLOCK_M=_BLOCK, BLOCK_N=_BLOCK, BLOCK_K=_BLOCK,
    )
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``c[rows of e] = a[rows of e] @ b[e]``; a tile spanning several experts loops over them, masked."""
    return _launch_grouped(a, b, offsets, a.shape[0], None, 1)


def gather_mm(x: torch.Tensor, w: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, k: int) -> torch.Tensor:
    """Fused gather + grouped GEMM: rows of ``x`` are read through ``perm // k``; no gathered copy of ``x``."""
    return _launch_grouped(x, w, offsets, perm.numel(), perm.contiguous(), k)


@triton.jit
def _wgrad_kernel(a_ptr, dc_ptr, offsets_ptr, db_ptr, kdim, m, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    e = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    end = tl.load(offsets_ptr + e)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    kmask = ks < kdim
    cmask = cols < m
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < end
        a = tl.load(a_ptr + rows[:, None] * kdim + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        dc = tl.load(dc_ptr + rows[:, None] * m + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            dc = dc.to(tl.float32)
        if IEEE:
            acc += tl.dot(tl.trans(a), dc, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(a), dc)
    tl.store(db_ptr + e * kdim * m + ks[:, None] * m + cols[None, :], acc.to(db_ptr.dtype.element_ty),
             mask=kmask[:, None] & cmask[None, :])


def grouped_mm_wgrad(a: torch.Tensor, dc: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``db[e] = a[rows of e]^T @ dc[rows of e]``; one program per (expert, K tile, M tile)."""
    num_experts, kdim, m = offsets.numel(), a.shape[1], dc.shape[1]
    db = torch.empty(num_experts, kdim, m, dtype=a.dtype, device=a.device)
    grid = (num_experts, triton.cdiv(kdim, _BLOCK), triton.cdiv(m, _BLOCK))
    _wgrad_kernel[grid](a.contiguous(), dc.contiguous(), offsets.contiguous(), db, kdim, m,
                        UPCAST=INTERPRET or a.dtype == torch.float32, IEEE=a.dtype == torch.float32,
                        BLOCK_K=_BLOCK, BLOCK_N=_BLOCK, BLOCK_R=_BLOCK)
    return db


# ----------------------------------------------------------------------------------------------- GLU


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:  # silu
        return g * tl.sigmoid(g)
    elif ACT == 1:  # gelu, tanh approximation
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:  # relu
        return tl.maximum(g, 0.0)


@triton.jit
def _act_grad(g, ACT: tl.constexpr):
    if ACT == 0:
        s = tl.sigmoid(g)
        return s + g * s * (1.0 - s)
    elif ACT == 1:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * g * g)
    else:
        return (g > 0).to(tl.float32)


@triton.jit
def _glu_fwd(g_ptr, u_ptr, out_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (_act(g, ACT) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd(g_ptr, u_ptr, dout_ptr, dg_ptr, du_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dg_ptr + offs, (dout * u * _act_grad(g, ACT)).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dout * _act(g, ACT)).to(du_ptr.dtype.element_ty), mask=mask)


_ACT_CODES = {"silu": 0, "gelu": 1, "relu": 2}


def _act_code(activation: str) -> int:
    if activation not in _ACT_CODES:
        raise ValueError(f"the triton GLU kernel supports {sorted(_ACT_CODES)}, not {activation!r}")
    return _ACT_CODES[activation]


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Fused ``act(gate) * up``."""
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _glu_fwd[(triton.cdiv(n, 1024),)](gate.contiguous(), up.contiguous(), out, n, ACT=_act_code(activation),
                                          BLOCK=1024)
    return out


def glu_backward(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, activation: str = "silu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`glu` with respect to ``gate`` and ``up``, recomputing the activation."""
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _glu_bwd[(triton.cdiv(n, 1024),)](gate.contiguous(), up.contiguous(), dout.contiguous(), dg, du, n,
                                          ACT=_act_code(activation), BLOCK=1024)
    return dg, du
