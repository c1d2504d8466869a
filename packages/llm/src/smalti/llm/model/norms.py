"""Normalisation layers: LayerNorm and RMSNorm, each with a low-precision variant for autocast runs."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smalti.llm.choices import NORM_TYPES
from smalti.llm.errors import ModelConfigError


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back (as Llama does)."""

    def __init__(self, dim: int, eps: float = 1e-5, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class RMSNormPlusOne(nn.Module):
    """``x / rms(x) * (1 + weight)`` in float32, cast back once (Gemma's norm: the weight starts at zero)."""

    def __init__(self, dim: int, eps: float = 1e-6, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class _LayerNormFunction(torch.autograd.Function):
    """PyTorch's fused LayerNorm forward and input gradient; weight and bias gradients summed over rows by
    ordinary reductions, which give the same bits for any number of threads."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, shape: list[int], eps: float
    ) -> torch.Tensor:
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)  # what nn.LayerNorm keeps: no extra memory
        ctx.shape, ctx.has_bias = shape, bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, rstd = ctx.saved_tensors
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if want_x:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                grad_out, x, ctx.shape, mean, rstd, weight, None, [True, False, False]
            )[0]
        rows = grad_out.reshape(-1, weight.numel() if weight is not None else x.shape[-1])
        if want_w:
            x_hat = (x.reshape(rows.shape) - mean.reshape(-1, 1)) * rstd.reshape(-1, 1)
            grad_w = (rows * x_hat).sum(0).view(weight.shape)
        if want_b:
            grad_b = rows.sum(0).view(weight.shape if weight is not None else ctx.shape)
        return grad_x, grad_w, grad_b, None, None


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose gradients on the CPU do not depend on the number of threads.

    PyTorch's fused CPU kernel sums the weight and bias gradients over rows in one buffer per intra-op thread and
    then adds the buffers, so their last bits change with the thread count (1 and 2 threads differ in every
    LayerNorm weight gradient of gpt_tiny, and in nothing else of the step). Here the fused kernel computes the
    output and the input gradient, and the weight and bias gradients are plain reductions over rows, one output
    element at a time, in the same order for any thread count. Same parameters, state-dict keys, outputs and
    saved tensors as ``nn.LayerNorm``; elsewhere (GPU, autocast, DTensor parameters, no gradients) it is
    ``nn.LayerNorm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        plain = type(x) is torch.Tensor and all(p is None or type(p.data) is torch.Tensor for p in (weight, bias))
        if x.device.type != "cpu" or not plain or not torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
            return super().forward(x)
        return _LayerNormFunction.apply(x, weight, bias, list(self.normalized_shape), self.eps)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class LowPrecisionLayerNorm(nn.LayerNorm):
    """LayerNorm that runs in the autocast dtype (bf16/fp16) instead of being upcast to float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        weight = self.weight.to(dtype) if self.weight is not None else None
        bias = self.bias.to(dtype) if self.bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x.to(dtype), self.normalized_shape, weight, bias, self.eps)


class LowPrecisionRMSNorm(RMSNorm):
    """RMSNorm computed in the autocast dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(dtype)
            return self.weight.to(dtype) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def make_norm(norm_type: str, dim: int, eps: float, bias: bool, device: torch.device | str | None = None) -> nn.Module:
    """Build the norm named ``norm_type`` (one of :data:`NORM_TYPES`)."""
    if norm_type == "layernorm":
        return LayerNorm(dim, eps=eps, bias=bias, device=device)
    if norm_type == "low_precision_layernorm":
        return LowPrecisionLayerNorm(dim, eps=eps, bias=bias, device=device)
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps=eps, device=device)
    if norm_type == "low_precision_rmsnorm":
        return LowPrecisionRMSNorm(dim, eps=eps, device=device)
    if norm_type == "rmsnorm_plus_one":
        return RMSNormPlusOne(dim, eps=eps, device=device)
    raise ModelConfigError(f"model.norm_type={norm_type!r} is not one of {', '.join(NORM_TYPES)}")
