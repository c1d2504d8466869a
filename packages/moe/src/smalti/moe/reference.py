"""Plain PyTorch versions of every MoE kernel: the CPU path and the oracle the Triton kernels are tested against.

Shapes: ``T`` tokens, ``k`` experts per token, ``N = T * k`` (token, slot) entries, ``E`` experts, ``D``
hidden size. Entry ``n`` is token ``n // k``, slot ``n % k``; "entry order" is that flat order and "sorted
order" groups the entries by expert (stable, so one expert's entries keep token order). ``perm[i]`` is the
entry at sorted position ``i``; ``offsets[e]`` is the exclusive end of expert ``e``'s rows in sorted order.

Each function here has a Triton twin in :mod:`smalti.moe.triton_kernels` with the same signature. They are
forward kernels: :mod:`smalti.moe.ops` wires them into autograd with explicit backward passes that call the
same backend's kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from smalti.moe import cpu_matmul


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort of the flat expert ids (``[T, k]`` or ``[N]``) and their histogram.

    Returns ``perm [N]`` (int64), ``counts [E]`` (int64) and ``offsets [E]`` (the inclusive cumulative sum of
    ``counts``: where each expert's run of sorted rows ends).
    """
    from smalti.moe.losses import expert_counts

    flat = expert_ids.reshape(-1)
    perm = torch.sort(flat, stable=True).indices
    counts = expert_counts(flat, num_experts)
    return perm, counts, torch.cumsum(counts, 0)


def gather_rows(x: torch.Tensor, perm: torch.Tensor, k: int) -> torch.Tensor:
    """``xs[i] = x[perm[i] // k]``: token rows copied into expert order, ``[N, D]``."""
    return x.index_select(0, torch.div(perm, k, rounding_mode="floor"))


def scatter_rows(ys: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    """``y[t] = sum_j w[t, j] * ys[sorted position of entry t*k + j]``: back to token order, summed over k.

    ``weights`` is ``[T, k]`` (``None``: unweighted sum). No scatter-add: the rows are put back in entry
    order by the inverse permutation, then each token's k rows are summed in fp32.
    """
    acc = torch.promote_types(ys.dtype, torch.float32)  # bf16/fp16 summed in fp32, fp64 kept
    entries = ys.index_select(0, inverse_permutation(perm)).view(-1, k, ys.shape[-1]).to(acc)
    if weights is not None:
        entries = entries * weights.unsqueeze(-1).to(acc)
    return entries.sum(1).to(ys.dtype)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inverse[perm[i]] = i``: the sorted position of each entry."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inverse


def _expert_slices(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    bounds = [0, *offsets.tolist()]
    return [(e, s, t) for e, (s, t) in enumerate(zip(bounds, bounds[1:])) if t > s]


def _fused_grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
    """``torch.nn.functional.grouped_mm`` where it takes the operands (fp32/bf16/fp16, 16-byte aligned strides):
    one call with the offsets on the device, so no host sync. ``None`` where it does not (e.g. float64)."""
    if a.dtype not in (torch.float32, torch.bfloat16, torch.float16) or a.dtype != b.dtype:
        return None
    try:
        return F.grouped_mm(a, b, offs=offsets.to(torch.int32))
    except (RuntimeError, TypeError, ValueError):
        return None


def _mm_per_expert(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]``, one 2-D product per expert slice (views, no copies), through the
    installed CPU product (:mod:`smalti.moe.cpu_matmul`) when there is one, else ``torch.mm``."""
    fn = cpu_matmul.for_operands(out, a, b)
    for e, s, t in _expert_slices(offsets):
        if fn is not None:
            fn(out[s:t], a[s:t], b[e])
        else:
            torch.mm(a[s:t], b[e], out=out[s:t])
    return out


def _grouped_sorted(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``a[rows of e] @ b[e]`` for the first ``offsets[-1]`` (sorted) rows of ``a``."""
    rows = int(offsets[-1]) if offsets.numel() else 0
    return _mm_per_expert(a.new_empty(rows, b.shape[-1]), a, b, offsets)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``c[rows of e] = a[rows of e] @ b[e]`` for rows sorted by expert: ``a [N, K]``, ``b [E, K, M]`` -> ``[N, M]``.

    ``b`` may be a strided view (e.g. ``w.transpose(1, 2)`` for the input gradient). Rows past
    ``offsets[-1]`` are left unwritten. With a CPU product installed (:mod:`smalti.moe.cpu_matmul`) each
    expert's rows go through it; otherwise one ``F.grouped_mm`` where it takes the operands.
    """
    if cpu_matmul.for_operands(a, b) is None:
        fused = _fused_grouped(a, b, offsets)
        if fused is not None:
            return fused
    return _mm_per_expert(a.new_empty(a.shape[0], b.shape[-1]), a, b, offsets)


def gather_mm(x: torch.Tensor, w: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, k: int) -> torch.Tensor:
    """Gather + grouped GEMM (ScatterMoE's grouped output): ``ys[i] = x[perm[i] // k] @ w[expert of i]``, sorted order."""
    return grouped_mm(gather_rows(x, perm, k), w, offsets)


def mm_scatter(h: torch.Tensor, w: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM with scattered output: ``z[perm[i]] = h[i] @ w[expert of i]``, ``[N, M]`` in entry order.

    Every entry row is written by exactly one sorted row, so no atomics are needed; rows of entries past
    ``offsets[-1]`` are zero.
    """
    if h.shape[0] == perm.numel():  # every entry has a sorted row: sizes known without reading offsets
        c = grouped_mm(h, w, offsets)
        # rows past offsets[-1] (dropped entries) are zero; the CPU product's loop read the offsets on the host
        # already, so there dropless routing (every entry kept) skips a full copy of c
        if offsets.numel() and (cpu_matmul.for_operands(c) is None or int(offsets[-1]) < c.shape[0]):
            kept = (torch.arange(c.shape[0], device=c.device) < offsets[-1]).unsqueeze(1)
            c = torch.where(kept, c, c.new_zeros(()))
        return c.index_select(0, inverse_permutation(perm))
    c = _grouped_sorted(h, w, offsets)
    if c.shape[0] == perm.numel():
        return c.index_select(0, inverse_permutation(perm))
    return h.new_zeros(perm.numel(), w.shape[-1]).index_copy_(0, perm[: c.shape[0]], c)


def grouped_mm_wgrad(a: torch.Tensor, dc: torch.Tensor, offsets: torch.Tensor, a_index: torch.Tensor | None = None,
                     dc_index: torch.Tensor | None = None) -> torch.Tensor:
    """Weight gradient of a grouped GEMM: ``db[e] = A[rows of e]^T @ DC[rows of e]``, ``[E, K, M]``.

    Sorted row ``r`` of ``A`` is ``a[a_index[r]]`` (or ``a[r]``), of ``DC`` is ``dc[dc_index[r]]`` (or
    ``dc[r]``): the fused paths read their operands in place instead of copying them into sorted order.
    """
    if a_index is not None:
        a = a.index_select(0, a_index)
    if dc_index is not None:
        dc = dc.index_select(0, dc_index)
    fn = cpu_matmul.for_operands(a, dc)
    fused = _fused_grouped(a.t(), dc, offsets) if offsets.numel() and fn is None else None
    if fused is not None:
        return fused
    out = a.new_empty(offsets.numel(), a.shape[1], dc.shape[1])
    slices = _expert_slices(offsets)
    for e, s, t in slices:
        if fn is not None:
            fn(out[e], a[s:t].t(), dc[s:t])
        else:
            torch.mm(a[s:t].t(), dc[s:t], out=out[e])
    used = {e for e, _, _ in slices}
    for e in range(offsets.numel()):
        if e not in used:  # an expert no row reached has a zero gradient
            out[e].zero_()
    return out


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_exact": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
}


# Each activation's input gradient written into ``out`` (a column slice of a packed gradient): aten's fused
# backward kernels, so nothing is recomputed through autograd and no separate buffer needs concatenating.
ACTIVATION_GRADS = {
    "gelu": lambda grad, x, out: torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh", grad_input=out),
    "gelu_exact": lambda grad, x, out: torch.ops.aten.gelu_backward.grad_input(grad, x, grad_input=out),
    "silu": lambda grad, x, out: torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=out),
    "relu": lambda grad, x, out: torch.ops.aten.threshold_backward.grad_input(grad, x, 0, grad_input=out),
}


def glu_packed(h: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """:func:`glu` of a packed ``h = [gate | up]`` (``[N, 2F]`` -> ``[N, F]``), computed in one output buffer."""
    gate, up = h.split(h.shape[-1] // 2, dim=-1)
    return ACTIVATIONS[activation](gate).mul_(up)


def glu_packed_backward(h: torch.Tensor, dout: torch.Tensor, activation: str = "silu", input_grad: bool = True
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Gradient of :func:`glu_packed` for ``h = [gate | up]``, as one ``[N, 2F]`` tensor (``None`` unless
    ``input_grad``), and the recomputed forward output ``act(gate) * up`` (what a following GEMM's weight
    gradient needs, so the forward pass need not keep it)."""
    gate, up = h.split(h.shape[-1] // 2, dim=-1)
    act = ACTIVATIONS[activation](gate)
    dh = None
    if input_grad:
        dh = torch.empty_like(h)
        torch.mul(dout, act, out=dh[:, gate.shape[-1]:])
        ACTIVATION_GRADS[activation](dout * up, gate, dh[:, : gate.shape[-1]])
    return dh, act.mul_(up)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The GLU activation ``act(gate) * up`` (SwiGLU for ``silu``); ``gate``/``up`` may be column slices of one tensor."""
    return ACTIVATIONS[activation](gate) * up


def glu_backward(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, activation: str = "silu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`glu` with respect to ``gate`` and ``up``, recomputing the activation."""
    with torch.enable_grad():
        g = gate.detach().requires_grad_()
        act = ACTIVATIONS[activation](g)
        (dact,) = torch.autograd.grad(act, g, dout * up)
    return dact, (dout * act).detach()
