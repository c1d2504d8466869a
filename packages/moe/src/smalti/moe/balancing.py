"""Aux-loss-free balancing (DeepSeek-V3): after each optimizer step, nudge every MoE layer's selection bias.

:class:`AuxFreeBiasUpdate` is a smalti-core plugin (``callbacks=[moe_bias_update]``) but imports nothing
from core; call :func:`update_expert_biases` yourself in any other loop.
"""

from __future__ import annotations

from typing import Any

import pluggy
import torch
from torch import nn

hookimpl = pluggy.HookimplMarker("smalti")


@torch.no_grad()
def update_expert_biases(model: nn.Module, coeff: float = 1e-3, group: Any = None) -> int:
    """Update the bias of every aux-free MoE layer in ``model`` from its expert counts since the last call.

    Counts are summed over the data-parallel ranks first (``group``, default world) when a process group
    is up, so every rank applies the same update. Returns the number of layers updated.
    """
    import torch.distributed as dist

    from smalti.moe.layer import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE) and m.router.expert_bias is not None]
    for layer in layers:
        counts = layer.tokens_per_expert.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=group)
        layer.update_expert_bias(coeff, counts)
    return len(layers)


class AuxFreeBiasUpdate:
    """Trainer plugin: runs :func:`update_expert_biases` in ``on_after_optimizer_step`` and logs the bias spread."""

    def __init__(self, coeff: float = 1e-3) -> None:
        self.coeff = coeff

    @hookimpl
    def on_after_optimizer_step(self, state: Any, logger: Any) -> None:
        model = state.raw_model
        if update_expert_biases(model, self.coeff):
            from smalti.moe.layer import MoE

            spread = max(float(m.router.expert_bias.abs().max()) for m in model.modules()
                         if isinstance(m, MoE) and m.router.expert_bias is not None)
            logger.log_metrics({"moe/expert_bias_max_abs": spread})
