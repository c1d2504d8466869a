"""Feed-forward layers: ``mlp`` (up, activation, down), ``glu`` (SwiGLU) and ``moe`` (smalti-moe)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from smalti.core.cpu_gemm import Linear
from smalti.llm.choices import ACTIVATIONS, FFN_TYPES
from smalti.llm.errors import ModelConfigError

_ACTIVATIONS = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU, "relu": nn.ReLU}
assert tuple(_ACTIVATIONS) == ACTIVATIONS, "smalti.llm.choices.ACTIVATIONS must list every activation"


def make_activation(name: str) -> nn.Module:
    """Activation module by name: gelu, gelu_tanh, silu or relu."""
    if name not in _ACTIVATIONS:
        raise ModelConfigError(f"model.activation={name!r} is not one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()


class MLP(nn.Module):
    """``down(act(up(x)))`` (MPT's FFN)."""

    def __init__(self, d_model: int, hidden: int, activation: str = "gelu", bias: bool = False, device: Any = None) -> None:
        super().__init__()
        self.up_proj = Linear(d_model, hidden, bias=bias, device=device)
        self.act = make_activation(activation)
        self.down_proj = Linear(hidden, d_model, bias=bias, device=device)
        self.down_proj._is_residual = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.down_proj(self.act(self.up_proj(x))), None


class GLU(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with ``activation=silu`` (Llama's FFN)."""

    def __init__(self, d_model: int, hidden: int, activation: str = "silu", bias: bool = False, device: Any = None) -> None:
        super().__init__()
        self.gate_proj = Linear(d_model, hidden, bias=bias, device=device)
        self.up_proj = Linear(d_model, hidden, bias=bias, device=device)
        self.act = make_activation(activation)
        self.down_proj = Linear(hidden, d_model, bias=bias, device=device)
        self.down_proj._is_residual = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)), None


class MoEFFN(nn.Module):
    """A smalti-moe mixture-of-experts layer; returns its output and its auxiliary (balancing) loss."""

    def __init__(self, d_model: int, hidden: int, activation: str, bias: bool, moe: dict[str, Any], device: Any = None) -> None:
        super().__init__()
        try:
            from smalti.moe import MoE
        except ImportError as exc:
            raise ModelConfigError(
                "model.ffn_type='moe' needs smalti-moe; install it (pip install smalti-moe) or choose ffn_type mlp/glu"
            ) from exc
        from smalti.llm.model.moe_adapter import install_cpu_matmul, moe_kwargs

        install_cpu_matmul()
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.moe = MoE(**moe_kwargs(d_model, hidden, activation, bias, moe))

    def forward(self, x: torch.Tensor,
                token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(y, aux)`` for ``x [B, T, d]``; ``token_weights [B, T]`` (the batch's ``attention_mask``) leaves
        padding out of the pooled balance statistics, as ``transformers``' ``load_balancing_loss_func`` does."""
        out = self.moe(x) if token_weights is None else self.moe(x, token_weights)
        if isinstance(out, tuple):
            y, aux = out[0], out[1]
            return y, aux
        return out, None


def make_ffn(
    ffn_type: str, d_model: int, hidden: int, activation: str, bias: bool, moe: dict[str, Any] | None, device: Any = None
) -> nn.Module:
    """Build the FFN named ``ffn_type`` (one of :data:`FFN_TYPES`)."""
    if ffn_type == "mlp":
        return MLP(d_model, hidden, activation, bias, device)
    if ffn_type == "glu":
        return GLU(d_model, hidden, activation, bias, device)
    if ffn_type == "moe":
        return MoEFFN(d_model, hidden, activation, bias, dict(moe or {}), device)
    raise ModelConfigError(f"model.ffn_type={ffn_type!r} is not one of {', '.join(FFN_TYPES)}")
