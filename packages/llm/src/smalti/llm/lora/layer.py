"""The LoRA linear layer: a frozen base ``nn.Linear`` plus trainable low-rank updates ``scaling * B @ A``.

It is an ``nn.Linear`` and keeps the base's ``weight`` and ``bias`` under their own names, so the model's state
dict, the Hugging Face importer and FSDP2 see the base unchanged; the adapters are ``lora_A.<part>`` ``[r, in]``
and ``lora_B.<part>`` ``[rows, r]`` (PEFT's layout). A fused layer (smalti's ``wqkv``) has one adapter per part
(``q``, ``k``, ``v``), each updating only its rows, exactly as PEFT's separate ``q_proj``/``k_proj``/``v_proj``.

The base may be held in a lower precision than the run (bf16) or as torchao's ``NF4Tensor`` (QLoRA); it is
dequantised for each product, and never receives a gradient.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from smalti.core import cpu_gemm
from smalti.llm.lora.naming import clean_name


class _FrozenLowPrecisionLinear(torch.autograd.Function):
    """``x W^T + b`` in ``x``'s dtype for a frozen ``W`` (and ``b``) held in a lower precision (a bf16 base under an
    fp32 run). ``F.linear(x, W.to(x.dtype))`` would make autograd keep the upcast copy of ``W`` for backward (twice
    the bytes of the stored weight, for every layer whose forward is not checkpointed); this keeps the stored
    ``W`` and upcasts it again in backward. Neither ``W`` nor ``b`` gets a gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight)
        return cpu_gemm.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        # grad_out @ W, as a linear against W^T (a view: no copy)
        grad_x = cpu_gemm.linear(grad_out, weight.to(grad_out.dtype).t()) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is torchao's 4-bit NormalFloat tensor (checked by name: torchao is optional)."""
    return type(tensor).__name__ == "NF4Tensor"


class LoRALinear(nn.Linear):
    """``y = x W^T + b + scaling * (dropout(x) A_p^T B_p^T)`` over each adapted row block ``p`` of ``W``.

    Args:
        base: the linear layer to adapt; its parameters are taken over (not copied).
        parts: ``[(name, first_row, stop_row), ...]`` covering the output rows (one part unless fused).
        adapted: the part names that get an adapter; the others stay frozen.
        r, scaling, dropout: the adapters' rank, the update's factor and the dropout on their input.
    """

    def __init__(self, base: nn.Linear, parts: list[tuple[str, int, int]], adapted: list[str], r: int,
                 scaling: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        for key, value in vars(base).items():  # markers such as _is_residual that init_weights reads
            if key.startswith("_is_"):
                setattr(self, key, value)
        self.parts = [(n, a, b) for n, a, b in parts]
        self.scaling = float(scaling)
        self.r = int(r)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device = base.weight.device
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, a, b in self.parts:
            if name in adapted:
                self.lora_A[name] = nn.Parameter(torch.empty(r, self.in_features, device=device, dtype=torch.float32))
                self.lora_B[name] = nn.Parameter(torch.empty(b - a, r, device=device, dtype=torch.float32))
        if device.type != "meta":
            self.reset_adapters()

    @torch.no_grad()
    def reset_adapters(self) -> None:
        """PEFT's default start: ``A`` Kaiming-uniform (a = sqrt(5)), ``B`` zero, so the model starts as the base."""
        for name in self.lora_A:
            nn.init.kaiming_uniform_(self.lora_A[name], a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[name])

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The base weight as a dense tensor (dequantised when it is NF4), in ``dtype`` when given."""
        w = self.weight
        if is_nf4(w):
            w = w.get_original_weight()
        return w if dtype is None or w.dtype == dtype else w.to(dtype)

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A`` for every part, as one ``[out, in]`` fp32 tensor (zero rows where not adapted)."""
        out = torch.zeros(self.out_features, self.in_features, dtype=torch.float32, device=self.lora_A_device())
        for name, a, b in self.parts:
            if name in self.lora_A:
                out[a:b] = (self.lora_B[name].float() @ self.lora_A[name].float()) * self.scaling
        return out

    def lora_A_device(self) -> torch.device:
        first = next(iter(self.lora_A.values()), None)
        return first.device if first is not None else self.weight.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        autocast = torch.is_autocast_enabled(x.device.type)
        if is_nf4(w):
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

            dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
            y = linear_nf4(x.to(dtype), w)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif autocast or w.dtype == x.dtype:
            y = cpu_gemm.linear(x, w, self.bias)
        elif w.requires_grad or (self.bias is not None and self.bias.requires_grad):
            y = cpu_gemm.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        else:  # a frozen bf16 base under an fp32 run: compute in the run's precision, keep the bf16 weight
            y = _FrozenLowPrecisionLinear.apply(x, w, self.bias)
        if not len(self.lora_A):
            return y
        h = self.lora_dropout(x)
        names = list(self.lora_A)
        if len(names) == 1 and len(self.parts) == 1:
            return y + cpu_gemm.linear(cpu_gemm.linear(h, self.lora_A[names[0]]), self.lora_B[names[0]]) * self.scaling
        # one product for every part's A, then each part's B on its slice of the rank dimension
        low = cpu_gemm.linear(h, torch.cat([self.lora_A[n] for n in names]))
        pieces, i = [], 0
        for name, a, b in self.parts:
            if name in self.lora_A:
                pieces.append(cpu_gemm.linear(low[..., i * self.r:(i + 1) * self.r], self.lora_B[name]))
                i += 1
            else:
                pieces.append(low.new_zeros(*low.shape[:-1], b - a))
        return y + torch.cat(pieces, -1).to(y.dtype) * self.scaling

    def extra_repr(self) -> str:
        adapted = ",".join(self.lora_A) or "none"
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, scaling={self.scaling:g}, adapted={adapted}"


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every :class:`LoRALinear` of ``model`` by its path (wrapper segments removed)."""
    return {clean_name(name): m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
