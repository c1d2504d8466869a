"""Output projection and cross-entropy in one pass over chunks of rows, never holding ``[rows, vocab]`` logits.

With a large vocabulary (Llama 3: 128,256) the logits of a training batch are most of its memory: at batch 2,
sequence 2,048 they are 2.1 GB in fp32, and the plain path keeps the log-softmax and its gradient as large
again. :func:`fused_linear_cross_entropy` computes, for one chunk of rows at a time, the logits, their
log-sum-exp, the loss, and (when gradients are wanted) the softmax gradient, which it turns at once into the
gradient of the hidden states (``dlogits @ W``) and adds into the gradient of the weight (``dlogits^T @ h``).
Only those two gradients (the sizes of ``hidden`` and ``weight``) wait for backward, which scales them by the
incoming gradient. The matrix products are the three of the plain path, none repeated; they go through
:func:`smalti.core.cpu_gemm.matmul_into`, which on CPUs where numpy's OpenBLAS beats torch's MKL (AMD) writes
them straight into their buffers with OpenBLAS, and elsewhere is ``torch.mm``/``addmm_``.

Rows whose target is ``ignore_index`` are masked (they count for nothing): dropping them before the projection
would need their number on the host, a wait for the device every step on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from smalti.core.cpu_gemm import matmul_into

#: Elements of one chunk's fp32 logits: 64M (256 MB; 523 rows of a 128K vocabulary). Smaller chunks cost time
#: (each adds a pass over the weight gradient): 128 rows took 23% more CPU time than 512 at vocab 128,256.
CHUNK_ELEMENTS = 1 << 26

#: Elements of one chunk's fp32 logits when the weight gets no gradient (a frozen head: LoRA, QLoRA, eval): 16M
#: (64 MB; 130 rows of a 128K vocabulary). Without a weight gradient there is no per-chunk pass over it, so
#: small chunks cost little time, and the chunk's logits are the loss's whole transient.
FROZEN_CHUNK_ELEMENTS = 1 << 24


#: Rows of the output weight converted at a time when it is held in another dtype than the products' (a frozen
#: bf16 head under an fp32 run, QLoRA's): converting the whole table at once would be the step's largest
#: transient (525 MB at 128,256 x 1,024 in fp32), larger than the chunk's logits themselves.
CAST_ROWS = 8192


def _logits(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``h @ weight.T`` in ``dtype``, converting ``weight`` :data:`CAST_ROWS` rows at a time when it is not."""
    out = torch.empty(h.shape[0], weight.shape[0], dtype=dtype, device=h.device)
    if weight.dtype == dtype:
        return matmul_into(out, h, weight.t())
    for v in range(0, weight.shape[0], CAST_ROWS):
        matmul_into(out[:, v : v + CAST_ROWS], h, weight[v : v + CAST_ROWS].to(dtype).t())
    return out


def _grad_hidden(dlogits: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """``out = dlogits @ weight`` in ``out``'s dtype, converting ``weight`` block by block as :func:`_logits`."""
    if weight.dtype == out.dtype:
        matmul_into(out, dlogits, weight)
        return
    for v in range(0, weight.shape[0], CAST_ROWS):
        block = weight[v : v + CAST_ROWS].to(out.dtype)
        matmul_into(out, dlogits[:, v : v + CAST_ROWS], block, accumulate=v > 0)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        reduction: str,
        chunk_rows: int,
    ) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = _compute_dtype(hidden)
        vocab = weight.shape[0]
        # Ignored rows are masked, not dropped: dropping them needs their number on the host, which on a GPU
        # waits for the device every step.
        valid = targets != ignore_index
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight  # converted to ``dtype`` block by block where it differs
            h = hidden.to(dtype)
            t = targets.masked_fill(~valid, 0)
            keep = valid.float()
            n = h.shape[0]
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(h) if want_h else None
            # the first chunk's product writes it, the later ones add (no zero fill of a [vocab, d] table)
            grad_w = (torch.empty if n else torch.zeros)(vocab, w.shape[1], dtype=torch.float32, device=w.device) \
                if want_w else None
            for start in range(0, n, chunk_rows):
                # the last chunk's logits go before this chunk's are made: never two chunks at once
                logits = exp = dlogits = None
                stop = min(start + chunk_rows, n)
                hc, tc = h[start:stop], t[start:stop]
                logits = _logits(hc, w, dtype).float()
                target_logit = logits.gather(1, tc[:, None]).squeeze(1)
                # One exp pass over the chunk, in place: exp(logits - max), its row sums give the log-sum-exp,
                # and the same buffer divided by them is the softmax.
                top = logits.amax(dim=-1, keepdim=True)
                exp = logits.sub_(top).exp_()
                sums = exp.sum(dim=-1)
                total += ((sums.log() + top.squeeze(1) - target_logit) * keep[start:stop]).sum()
                if not (want_h or want_w):
                    continue
                # (softmax - one_hot(target)) * keep: the gradient of the summed loss with respect to this chunk's
                # logits, in one pass over them (keep is 0 or 1, so 1/sum * keep is exactly 1/sum or 0).
                row_keep = keep[start:stop]
                dlogits = exp.mul_((sums.reciprocal_() * row_keep)[:, None])
                dlogits[torch.arange(stop - start, device=dlogits.device), tc] -= row_keep
                dlogits = dlogits.to(dtype)
                if grad_h is not None:
                    _grad_hidden(dlogits, w, grad_h[start:stop])
                if grad_w is not None:
                    if dtype == torch.float32:
                        matmul_into(grad_w, dlogits.t(), hc, accumulate=start > 0)
                    elif start > 0:
                        grad_w += torch.mm(dlogits.t(), hc).float()
                    else:
                        grad_w.copy_(torch.mm(dlogits.t(), hc))
            if reduction == "mean":
                scale = keep.sum().clamp(min=1.0).reciprocal()  # stays on the device
                total = total * scale
            if grad_h is not None:
                if reduction == "mean":
                    grad_h.mul_(scale.to(grad_h.dtype))
                grad_h = grad_h.to(hidden.dtype)
            if grad_w is not None:
                if reduction == "mean":
                    grad_w.mul_(scale)
                grad_w = grad_w.to(weight.dtype)
        ctx.has_h, ctx.has_w = grad_h is not None, grad_w is not None
        ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
        ctx.used = False
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.used:
            raise RuntimeError("fused_linear_cross_entropy supports one backward per forward (no retain_graph)")
        ctx.used = True
        saved = list(ctx.saved_tensors)
        grad_h = saved.pop(0) if ctx.has_h else None
        grad_w = saved.pop(0) if ctx.has_w else None
        # The precomputed gradients are used once: scale them in place rather than allocating copies.
        if grad_h is not None:
            grad_h.mul_(grad_out.to(grad_h.dtype))
        if grad_w is not None:
            grad_w.mul_(grad_out.to(grad_w.dtype))
        return grad_h, grad_w, None, None, None, None


def default_chunk_rows(weight: torch.Tensor) -> int:
    """Rows per chunk of :func:`fused_linear_cross_entropy` against ``weight`` ``[V, d]``: a memory budget of fp32
    logits, the smaller :data:`FROZEN_CHUNK_ELEMENTS` when ``weight`` will get no gradient."""
    frozen = not (weight.requires_grad and torch.is_grad_enabled())
    return max(1, (FROZEN_CHUNK_ELEMENTS if frozen else CHUNK_ELEMENTS) // weight.shape[0])


# Left to eager under torch.compile: the chunk loop is matrix products and data-dependent row selection, which
# Inductor would not speed up and dynamo would break the graph on anyway.
@torch.compiler.disable
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets, ignore_index=..., reduction=...)`` without the logits.

    Args:
        hidden: ``[N, d]`` (or ``[..., d]``, flattened) inputs of the output projection.
        weight: ``[V, d]`` output projection (the tied embedding or the LM head).
        targets: ``[N]`` (or matching ``hidden``'s leading shape) class indices; ``ignore_index`` rows count
            for nothing.
        reduction: ``mean`` (over valid rows; 0 when there are none) or ``sum``.
        chunk_rows: rows per chunk; default so that one chunk's fp32 logits hold :data:`CHUNK_ELEMENTS`, or
            :data:`FROZEN_CHUNK_ELEMENTS` when ``weight`` gets no gradient.

    Logits are computed in the autocast dtype when autocast is on (else ``hidden``'s dtype), softmax in fp32.
    Gradients are computed during the forward when ``hidden`` or ``weight`` requires them, so backward may run
    once per forward.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} is not one of mean, sum")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets has {targets.shape[0]} rows, hidden has {hidden.shape[0]}")
    rows = chunk_rows or default_chunk_rows(weight)
    return _FusedLinearCrossEntropy.apply(hidden, weight, targets, ignore_index, reduction, int(rows))
