"""Optimizers whose weight decay follows the learning-rate schedule (Loshchilov & Hutter's decoupling).

``torch.optim.AdamW`` decays by ``lr * weight_decay``, so changing the peak LR also changes the decay.
Here the decay is ``weight_decay * lr / initial_lr``: ``weight_decay`` is the decay per step at the peak,
and it shrinks with the schedule, as Composer's ``DecoupledAdamW`` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class _DecoupledWeightDecay:
    """Mixin: takes ``weight_decay`` away from the base optimizer and applies it scaled by ``lr / initial_lr``."""

    param_groups: list[dict[str, Any]]

    def _take_weight_decay(self, weight_decay: float) -> None:
        for group in self.param_groups:
            group["decoupled_weight_decay"] = weight_decay
            group.setdefault("initial_lr", group["lr"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            decay = group["decoupled_weight_decay"]
            if decay:
                factor = decay * group["lr"] / group["initial_lr"]
                for p in group["params"]:
                    if p.grad is not None:
                        p.mul_(1 - factor)
        return super().step(closure)  # type: ignore[misc]


class DecoupledAdamW(_DecoupledWeightDecay, torch.optim.AdamW):
    """AdamW with weight decay ``weight_decay * lr / initial_lr`` (default ``weight_decay=1e-5``)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=0.0, **kwargs)
        self._take_weight_decay(weight_decay)


class DecoupledSGDW(_DecoupledWeightDecay, torch.optim.SGD):
    """SGD with weight decay ``weight_decay * lr / initial_lr``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, momentum: float = 0.0,
                 weight_decay: float = 0.0, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=0.0, **kwargs)
        self._take_weight_decay(weight_decay)
