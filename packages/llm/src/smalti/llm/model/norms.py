"""Normalisation layers: LayerNorm and RMSNorm, each with a low-precision variant for autocast runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from smalti.llm.errors import ModelConfigError

NORM_TYPES = ("layernorm", "rmsnorm", "low_precision_layernorm", "low_precision_rmsnorm")


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
        return nn.LayerNorm(dim, eps=eps, bias=bias, device=device)
    if norm_type == "low_precision_layernorm":
        return LowPrecisionLayerNorm(dim, eps=eps, bias=bias, device=device)
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps=eps, device=device)
    if norm_type == "low_precision_rmsnorm":
        return LowPrecisionRMSNorm(dim, eps=eps, device=device)
    raise ModelConfigError(f"model.norm_type={norm_type!r} is not one of {', '.join(NORM_TYPES)}")
