"""Triton kernels for the MoE layer, each with the signature of its twin in :mod:`smalti.moe.reference`.

Written for both a GPU and Triton's CPU interpreter (``TRITON_INTERPRET=1``, read by Triton when this
module's kernels are decorated, i.e. at import), which the CPU tests use. Interpreter limits handled here:

* one autotune config when interpreting (several fail at launch with "0 active drivers");
* operands upcast to fp32 before ``tl.dot`` when interpreting (the interpreter multiplies bf16 bit
  patterns as integers);
* tiles of at least 16 in every ``tl.dot`` dimension (the GPU's minimum).

Grouped GEMMs follow ScatterMoE: only integer indices are sorted; a GEMM reads its rows through an index
(``perm // k``) and may write its output rows through one (``perm``), so no padded or gathered copy of
the activations is made. Each GEMM program owns one tile of one expert's rows (a tile schedule built on
the device from the expert offsets, no host sync), so no tile mixes experts.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_SORT_BLOCK = 128 if INTERPRET else 1024
_COPY_BLOCK_M = 32 if INTERPRET else 64
_COPY_BLOCK_D = 64 if INTERPRET else 128
# The scatter holds an fp32 [BLOCK_M, BLOCK_D] accumulator across its loop over k: at 64 rows ptxas spilled on
# sm_90 (python -m smalti.moe.aot; 8 warps did not cure it), at 32 rows no target or dtype spills.
_SCATTER_BLOCK_M = 32


def _configs(gpu: list[dict], interpreted: dict) -> list[triton.Config]:
    """Autotune configs: several on a GPU, exactly one under the interpreter."""
    if INTERPRET:
        return [triton.Config(interpreted, num_warps=4, num_stages=1)]
    return [triton.Config({k: v for k, v in c.items() if k not in ("num_warps", "num_stages")},
                          num_warps=c.get("num_warps", 4), num_stages=c.get("num_stages", 3)) for c in gpu]


def _upcast(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be converted to fp32 first (interpreter, or fp32 kept exact)."""
    return INTERPRET or dtype == torch.float32


# ----------------------------------------------------------------------------------------------- sort


@triton.jit
def _block_histogram_kernel(ids_ptr, block_counts_ptr, n, num_experts, BLOCK: tl.constexpr, EP: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask, other=EP - 1)  # padding lands in a bin past the experts
    hist = tl.histogram(ids, EP)
    experts = tl.arange(0, EP)
    tl.store(block_counts_ptr + b * num_experts + experts, hist, mask=experts < num_experts)


@triton.jit
def _block_place_kernel(ids_ptr, perm_ptr, base_ptr, first_ptr, n, num_experts, BLOCK: tl.constexpr):
    # Sort this block's entries by (expert, position) with one packed key, then send sorted entry i of
    # expert e to base[b, e] + (i - first[b, e]): the block's share of e's rows, in entry order.
    b = tl.program_id(0)
    local = tl.arange(0, BLOCK)
    offs = b * BLOCK + local
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=num_experts)
    keys = tl.sort(ids * BLOCK + local)
    expert = keys // BLOCK
    src = keys - expert * BLOCK
    valid = expert < num_experts
    first = tl.load(first_ptr + b * num_experts + expert, mask=valid, other=0)
    base = tl.load(base_ptr + b * num_experts + expert, mask=valid, other=0)
    tl.store(perm_ptr + base + (local - first), (b * BLOCK + src).to(tl.int64), mask=valid)


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort by expert in two parallel passes (per-block histograms, then per-block placement).

    The prefix sums between the passes are a few tiny torch ops on ``[blocks, E]``; see
    :func:`smalti.moe.reference.sort_by_expert` for the outputs.
    """
    flat = expert_ids.reshape(-1).to(torch.int32).contiguous()
    n, dev = flat.numel(), flat.device
    blocks = max(1, triton.cdiv(n, _SORT_BLOCK))
    block_counts = torch.zeros(blocks, num_experts, dtype=torch.int32, device=dev)
    perm = torch.empty(n, dtype=torch.int64, device=dev)
    ep = max(16, triton.next_power_of_2(num_experts + 1))
    if n:
        _block_histogram_kernel[(blocks,)](flat, block_counts, n, num_experts, BLOCK=_SORT_BLOCK, EP=ep)
    counts = block_counts.sum(0, dtype=torch.int64)
    offsets = torch.cumsum(counts, 0)
    before = torch.cumsum(block_counts, 0, dtype=torch.int32) - block_counts  # earlier blocks' rows of e
    base = (offsets - counts).to(torch.int32)[None, :] + before
    first = torch.cumsum(block_counts, 1, dtype=torch.int32) - block_counts
    if n:
        _block_place_kernel[(blocks,)](flat, perm, base.contiguous(), first.contiguous(), n, num_experts,
                                       BLOCK=_SORT_BLOCK)
    return perm, counts, offsets


# ----------------------------------------------------------------------------------------------- gather / scatter


@triton.jit
def _gather_kernel(x_ptr, idx_ptr, out_ptr, n, d, k, s_x, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < n
    src = tl.load(idx_ptr + rows, mask=rmask, other=0) // k
    mask = rmask[:, None] & (cols[None, :] < d)
    vals = tl.load(x_ptr + src[:, None] * s_x + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * d + cols[None, :], vals, mask=mask)


def gather_rows(x: torch.Tensor, perm: torch.Tensor, k: int) -> torch.Tensor:
    """``xs[i] = x[perm[i] // k]``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, d = perm.numel(), x.shape[1]
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n and d:
        grid = (triton.cdiv(n, _COPY_BLOCK_M), triton.cdiv(d, _COPY_BLOCK_D))
        _gather_kernel[grid](x, perm.contiguous(), out, n, d, k, x.stride(0),
                             BLOCK_M=_COPY_BLOCK_M, BLOCK_D=_COPY_BLOCK_D)
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
        entry = tokens.to(tl.int64) * k + j
        src = tl.load(inv_ptr + entry, mask=tmask, other=0)
        vals = tl.load(ys_ptr + src[:, None] * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + entry, mask=tmask, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += vals
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * d + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inverse[perm[i]] = i``: the sorted position of each entry."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inverse


def scatter_rows(ys: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    """Weighted sum over the k slots back in token order; each output row is written once (no atomics)."""
    ys = ys.contiguous()
    n, d = ys.shape
    t = n // k
    out = torch.empty(t, d, dtype=ys.dtype, device=ys.device)
    if t and d:
        w = weights.contiguous() if weights is not None else ys
        grid = (triton.cdiv(t, _SCATTER_BLOCK_M), triton.cdiv(d, _COPY_BLOCK_D))
        _scatter_kernel[grid](ys, inverse_permutation(perm), w, out, t, d, k, HAS_W=weights is not None,
                              BLOCK_M=_SCATTER_BLOCK_M, BLOCK_D=_COPY_BLOCK_D)
    return out


# ----------------------------------------------------------------------------------------------- grouped GEMM

_GMM_BLOCK_M = 16 if INTERPRET else 128


_GMM_16BIT = [dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
              dict(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
              dict(BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4),
              dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)]
# fp32 runs tl.dot in IEEE mode (FMA, no tensor cores) on 4-byte tiles: the 16-bit list spilled up to 12 KB and
# BLOCK_N=256 needed 196608 B of shared memory (> sm_80's 166912) per `python -m smalti.moe.aot`. These do not.
_GMM_FP32 = [dict(BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3),
             dict(BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=3)]
_GMM_CONFIGS = _configs(_GMM_16BIT + _GMM_FP32, dict(BLOCK_N=32, BLOCK_K=32))


def _by_dtype(configs: list[triton.Config], n_16bit: int):
    """An autotune prune keeping ``configs[n_16bit:]`` for fp32 (``IEEE``) launches, the rest otherwise."""
    fp32_ids = {id(c) for c in configs[n_16bit:]}

    def prune(candidates: list, named_args: dict, **kwargs) -> list:
        if INTERPRET:  # one config only
            return candidates
        ieee = bool(kwargs.get("IEEE", named_args.get("IEEE")))
        return [c for c in candidates if (id(c) in fp32_ids) == ieee]

    return prune


@triton.autotune(
    configs=_GMM_CONFIGS,
    key=["kdim", "m", "BLOCK_M", "A_GATHER", "C_SCATTER", "IEEE"],
    prune_configs_by={"early_config_prune": _by_dtype(_GMM_CONFIGS, len(_GMM_16BIT))},
)
@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, a_idx_ptr, c_idx_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
                       kdim, m, s_am, s_be, s_bk, s_bn, s_cm,
                       A_GATHER: tl.constexpr, C_SCATTER: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    active = expert >= 0
    e = tl.maximum(expert, 0).to(tl.int64)
    end = tl.where(active, tl.load(ends_ptr + e), row0)  # a spare tile owns no rows
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < m
    if A_GATHER:
        src = tl.load(a_idx_ptr + rows, mask=rmask, other=0)
    else:
        src = rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.where(active, kdim, 0), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < kdim
        a = tl.load(a_ptr + src[:, None] * s_am + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + e * s_be + ks[:, None] * s_bk + cols[None, :] * s_bn,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if C_SCATTER:
        dst = tl.load(c_idx_ptr + rows, mask=rmask, other=0)
    else:
        dst = rows
    tl.store(c_ptr + dst[:, None] * s_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


def _tile_schedule(offsets: torch.Tensor, rows_bound: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile ``i``: expert ``tile_expert[i]`` (-1 for a spare tile) and first sorted row ``tile_row[i]``.

    The number of tiles is an upper bound (``cdiv(rows, BLOCK_M) + E``) so the launch needs no host sync.
    """
    num_experts = offsets.numel()
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    idx = torch.arange(triton.cdiv(rows_bound, block_m) + num_experts, device=offsets.device, dtype=offsets.dtype)
    expert = torch.searchsorted(tile_end, idx, right=True)
    safe = expert.clamp(max=num_experts - 1)
    row = (offsets - counts)[safe] + (idx - (tile_end - tiles)[safe]) * block_m
    return torch.where(expert < num_experts, expert, -1).to(torch.int32), row.to(torch.int64)


def _grouped(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, out_rows: int, a_index: torch.Tensor | None,
             c_index: torch.Tensor | None) -> torch.Tensor:
    if a.stride(-1) != 1:
        a = a.contiguous()
    kdim, m = w.shape[1], w.shape[2]
    scatter = c_index is not None
    out = (torch.zeros if scatter else torch.empty)(out_rows, m, dtype=a.dtype, device=a.device)
    rows_bound = a_index.numel() if a_index is not None else (c_index.numel() if scatter else a.shape[0])
    if rows_bound == 0 or m == 0 or offsets.numel() == 0:
        return out
    offsets = offsets.to(torch.int64).contiguous()
    tile_expert, tile_row = _tile_schedule(offsets, rows_bound, _GMM_BLOCK_M)
    grid = lambda meta: (tile_expert.numel(), triton.cdiv(m, meta["BLOCK_N"]))  # noqa: E731
    _grouped_mm_kernel[grid](
        a, w, out, a_index if a_index is not None else tile_row, c_index if scatter else tile_row,
        tile_expert, tile_row, offsets, kdim, m, a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        A_GATHER=a_index is not None, C_SCATTER=scatter, UPCAST=_upcast(a.dtype), IEEE=a.dtype == torch.float32,
        BLOCK_M=_GMM_BLOCK_M,
    )
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``c[rows of e] = a[rows of e] @ b[e]``; ``b`` may be strided (e.g. ``w.transpose(1, 2)``, no copy)."""
    return _grouped(a, b, offsets, a.shape[0], None, None)


def gather_mm(x: torch.Tensor, w: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, k: int) -> torch.Tensor:
    """Fused gather + grouped GEMM: rows of ``x`` are read through ``perm // k``; no gathered copy of ``x``."""
    index = perm if k == 1 else torch.div(perm, k, rounding_mode="floor")
    return _grouped(x, w, offsets, perm.numel(), index.contiguous(), None)


def mm_scatter(h: torch.Tensor, w: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Fused grouped GEMM + scatter: sorted row ``i`` is written to entry row ``perm[i]`` (unique: no atomics)."""
    return _grouped(h, w, offsets, perm.numel(), None, perm.contiguous())


_WGRAD_16BIT = [dict(BLOCK_K=128, BLOCK_N=128, BLOCK_R=32, num_warps=8, num_stages=3),
                dict(BLOCK_K=64, BLOCK_N=128, BLOCK_R=64, num_warps=4, num_stages=3),
                dict(BLOCK_K=64, BLOCK_N=64, BLOCK_R=64, num_warps=4, num_stages=4)]
# In fp32 (IEEE) the two 4-warp configs spilled 9-15 KB on sm_80 (python -m smalti.moe.aot); 8 warps do not.
_WGRAD_FP32 = [dict(BLOCK_K=128, BLOCK_N=128, BLOCK_R=32, num_warps=8, num_stages=3)]
_WGRAD_CONFIGS = _configs(_WGRAD_16BIT + _WGRAD_FP32, dict(BLOCK_K=32, BLOCK_N=32, BLOCK_R=32))


@triton.autotune(
    configs=_WGRAD_CONFIGS,
    key=["kdim", "m", "A_GATHER", "DC_GATHER", "IEEE"],
    prune_configs_by={"early_config_prune": _by_dtype(_WGRAD_CONFIGS, len(_WGRAD_16BIT))},
)
@triton.jit
def _wgrad_kernel(a_ptr, dc_ptr, db_ptr, a_idx_ptr, dc_idx_ptr, ends_ptr, kdim, m, s_am, s_dcm,
                  A_GATHER: tl.constexpr, DC_GATHER: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    end = tl.load(ends_ptr + e)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    kmask = ks < kdim
    cmask = cols < m
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < end
        if A_GATHER:
            a_src = tl.load(a_idx_ptr + rows, mask=rmask, other=0)
        else:
            a_src = rows
        if DC_GATHER:
            dc_src = tl.load(dc_idx_ptr + rows, mask=rmask, other=0)
        else:
            dc_src = rows
        a_t = tl.load(a_ptr + a_src[None, :] * s_am + ks[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
        dc = tl.load(dc_ptr + dc_src[:, None] * s_dcm + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        if UPCAST:
            a_t = a_t.to(tl.float32)
            dc = dc.to(tl.float32)
        if IEEE:
            acc += tl.dot(a_t, dc, input_precision="ieee")
        else:
            acc += tl.dot(a_t, dc)
    tl.store(db_ptr + e * kdim * m + ks[:, None] * m + cols[None, :], acc.to(db_ptr.dtype.element_ty),
             mask=kmask[:, None] & cmask[None, :])


def grouped_mm_wgrad(a: torch.Tensor, dc: torch.Tensor, offsets: torch.Tensor, a_index: torch.Tensor | None = None,
                     dc_index: torch.Tensor | None = None) -> torch.Tensor:
    """``db[e] = A[rows of e]^T @ DC[rows of e]`` with optional row indices; one program per (expert, K, M tile)."""
    a, dc = a.contiguous(), dc.contiguous()
    num_experts, kdim, m = offsets.numel(), a.shape[1], dc.shape[1]
    db = torch.empty(num_experts, kdim, m, dtype=a.dtype, device=a.device)
    if not (num_experts and kdim and m):
        return db
    offsets = offsets.to(torch.int64).contiguous()
    grid = lambda meta: (num_experts, triton.cdiv(kdim, meta["BLOCK_K"]), triton.cdiv(m, meta["BLOCK_N"]))  # noqa: E731
    _wgrad_kernel[grid](
        a, dc, db, a_index.contiguous() if a_index is not None else offsets,
        dc_index.contiguous() if dc_index is not None else offsets, offsets, kdim, m, a.stride(0), dc.stride(0),
        A_GATHER=a_index is not None, DC_GATHER=dc_index is not None, UPCAST=_upcast(a.dtype),
        IEEE=a.dtype == torch.float32,
    )
    return db


# ----------------------------------------------------------------------------------------------- GLU


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:  # silu
        return g * tl.sigmoid(g)
    elif ACT == 1:  # gelu, tanh approximation: tanh(z) = 2 sigmoid(2z) - 1
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
def _glu_kernel(g_ptr, u_ptr, dout_ptr, out_ptr, dg_ptr, du_ptr, rows, cols, s_g, s_u,
                ACT: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    r64 = r[:, None].to(tl.int64)
    g = tl.load(g_ptr + r64 * s_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * s_u + c[None, :], mask=mask, other=0.0).to(tl.float32)
    dense = r64 * cols + c[None, :]
    if BACKWARD:
        dout = tl.load(dout_ptr + dense, mask=mask, other=0.0).to(tl.float32)
        tl.store(dg_ptr + dense, (dout * u * _act_grad(g, ACT)).to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + dense, (dout * _act(g, ACT)).to(du_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + dense, (_act(g, ACT) * u).to(out_ptr.dtype.element_ty), mask=mask)


_ACT_CODES = {"silu": 0, "gelu": 1, "relu": 2}
_GLU_BLOCK_R, _GLU_BLOCK_C = 16, 128


def _act_code(activation: str) -> int:
    if activation not in _ACT_CODES:
        raise ValueError(f"the triton GLU kernel supports {sorted(_ACT_CODES)}, not {activation!r}")
    return _ACT_CODES[activation]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Fused ``act(gate) * up``; ``gate``/``up`` may be column slices of one ``[N, 2F]`` tensor (no copy)."""
    gate, up = _rows(gate), _rows(up)
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    if out.numel():
        grid = (triton.cdiv(rows, _GLU_BLOCK_R), triton.cdiv(cols, _GLU_BLOCK_C))
        _glu_kernel[grid](gate, up, out, out, out, out, rows, cols, gate.stride(0), up.stride(0),
                          ACT=_act_code(activation), BACKWARD=False, BLOCK_R=_GLU_BLOCK_R, BLOCK_C=_GLU_BLOCK_C)
    return out


def glu_backward(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, activation: str = "silu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`glu` with respect to ``gate`` and ``up``, recomputing the activation."""
    gate, up, dout = _rows(gate), _rows(up), dout.contiguous()
    rows, cols = gate.shape
    dg = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    du = torch.empty_like(dg)
    if dg.numel():
        grid = (triton.cdiv(rows, _GLU_BLOCK_R), triton.cdiv(cols, _GLU_BLOCK_C))
        _glu_kernel[grid](gate, up, dout, dg, dg, du, rows, cols, gate.stride(0), up.stride(0),
                          ACT=_act_code(activation), BACKWARD=True, BLOCK_R=_GLU_BLOCK_R, BLOCK_C=_GLU_BLOCK_C)
    return dg, du
