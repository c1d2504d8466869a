"""LoRA on every expert of a smalti-moe layer: a rank-``r`` update per expert of the stacked ``w1 [E, d, up]``
(gate and up columns together) and ``w2 [E, ffn, d]``, as PEFT's ``LoraConfig(target_parameters=...)`` puts on
transformers' fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (its ``ParamWrapper``).

Expert ``e``'s update is ``scaling * (B_e @ A_e)`` in Hugging Face's ``[out, in]`` orientation, so smalti's
``[in, out]`` weight gets its transpose. ``A [E, r, in]`` and ``B [E, out, r]`` keep one expert per leading
index, so expert parallelism slices them as it slices the experts. Each forward folds the updates into the
experts the rank holds (``W + scaling * A^T B^T``, one batched matmul) and runs the layer's own dropless grouped
GEMMs on the result, as PEFT's parametrisation does: no second routing pass and exact gradients for ``A``/``B``.
PEFT cannot apply dropout to a weight update, so adapted experts take none (``model.lora.dropout`` must be 0).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from smalti.llm.lora.naming import clean_name
from smalti.moe import MoE

#: The stacked expert weights an adapter can target, with their (input, output) sizes on a layer.
EXPERT_WEIGHTS = ("w1", "w2")


def _sizes(layer: MoE, name: str) -> tuple[int, int]:
    """(in, out) of one expert's ``name`` weight (``w1 [E, in, out]``)."""
    weight = getattr(layer, name)
    return int(weight.shape[1]), int(weight.shape[2])


class ExpertAdapters(nn.Module):
    """The ``lora_A [E, r, in]`` / ``lora_B [E, out, r]`` of each adapted expert weight (fp32, trainable).

    A module of its own (called in the layer's forward) so FSDP2 gathers it before use when the layer's
    children are sharded separately, as ``parallelism=fsdp_ep`` does.
    """

    def __init__(self, sizes: dict[str, tuple[int, int]], num_experts: int, r: int, scaling: float,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.r, self.scaling = int(r), float(scaling)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, (fan_in, fan_out) in sizes.items():
            self.lora_A[name] = nn.Parameter(torch.empty(num_experts, r, fan_in, device=device, dtype=torch.float32))
            self.lora_B[name] = nn.Parameter(torch.empty(num_experts, fan_out, r, device=device, dtype=torch.float32))

    @torch.no_grad()
    def reset_adapters(self) -> None:
        """PEFT's start: each expert's ``A`` Kaiming-uniform (a = sqrt(5), fan-in = the weight's input size), ``B``
        zero, so the layer starts as the base."""
        for name in self.lora_A:
            a = self.lora_A[name]
            nn.init.kaiming_uniform_(a.view(-1, a.shape[-1]), a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[name])

    def forward(self, weights: dict[str, torch.Tensor], first: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``weights`` (the experts ``first ..`` a rank holds, by name) with their updates added, in ``dtype``."""
        out = {}
        for name, w in weights.items():
            if name in self.lora_A:
                n = w.shape[0]
                a = self.lora_A[name][first:first + n].transpose(1, 2)
                b = self.lora_B[name][first:first + n].transpose(1, 2)
                w = torch.baddbmm(w.float(), a.float(), b.float(), alpha=self.scaling)
            out[name] = w if w.dtype == dtype else w.to(dtype)
        return out


class LoRAExperts(MoE):
    """A smalti-moe :class:`~smalti.moe.MoE` whose routed experts carry per-expert LoRA updates
    (:class:`ExpertAdapters` in ``adapters``); routing, shared experts and balancing losses are the base layer's.

    Built by :meth:`adapt` from an existing layer, whose parameters it takes over under their usual names (so
    weight loading, FSDP2 and expert parallelism see the layer they know).
    """

    adapters: ExpertAdapters

    @classmethod
    def adapt(cls, base: MoE, adapted: list[str], r: int, scaling: float) -> LoRAExperts:
        """``base`` with adapters on its ``adapted`` expert weights (``w1``, ``w2``)."""
        layer = cls.__new__(cls)
        copied = ("_parameters", "_buffers", "_modules")
        layer.__dict__.update({k: dict(v) if k in copied else v for k, v in vars(base).items()})
        sizes = {name: _sizes(base, name) for name in EXPERT_WEIGHTS if name in adapted}
        layer.adapters = ExpertAdapters(sizes, base.num_experts, r, scaling, device=base.w1.device)
        if base.w1.device.type != "meta":
            layer.adapters.reset_adapters()
        return layer

    def reset_adapters(self) -> None:
        """See :meth:`ExpertAdapters.reset_adapters`."""
        self.adapters.reset_adapters()

    def experts_forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                        w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """See :meth:`MoE.experts_forward`: the experts given (this rank's under expert parallelism) with their
        updates folded in."""
        first = 0
        if w1.shape[0] != self.num_experts:  # expert parallelism: this rank's consecutive block of experts
            import torch.distributed as dist

            first = dist.get_rank(self.expert_group) * w1.shape[0]
        merged = self.adapters({"w1": w1, "w2": w2}, first, tokens.dtype)
        return super().experts_forward(tokens, expert_ids, weights, merged["w1"], merged["w2"])


def expert_lora_layers(model: nn.Module) -> dict[str, LoRAExperts]:
    """Every :class:`LoRAExperts` of ``model`` by its path (wrapper segments removed)."""
    return {clean_name(name): m for name, m in model.named_modules() if isinstance(m, LoRAExperts)}
