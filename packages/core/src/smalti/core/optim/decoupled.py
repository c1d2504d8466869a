"""Optimizers whose weight decay follows the learning-rate schedule (Loshchilov & Hutter's decoupling).

``torch.optim.AdamW`` decays by ``lr * weight_decay``, so changing the peak LR also changes the decay.
Here the decay is ``weight_decay * lr / initial_lr``: ``weight_decay`` is the decay per step at the peak,
and it shrinks with the schedule, as Composer's ``DecoupledAdamW`` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from smalti.core.config.types import NonNegativeFloat, PositiveFloat, ProperFraction

#: The param-group key of the decay per step at the peak LR. Not ``decoupled_weight_decay``: torch's Adam owns
#: that key (a bool) and AdamW sets it to True whenever a state dict is loaded, which read as a decay of 1.0
#: zeroed every weight on the first step after a resume.
DECAY_KEY = "smalti_decoupled_weight_decay"
_OLD_KEY = "decoupled_weight_decay"  # what checkpoints written before the rename hold (a float)


class _DecoupledWeightDecay:
    """Mixin: takes ``weight_decay`` away from the base optimizer and applies it scaled by ``lr / initial_lr``."""

    param_groups: list[dict[str, Any]]

    def _take_weight_decay(self, weight_decay: float) -> None:
        for group in self.param_groups:
            group[DECAY_KEY] = weight_decay
            group.setdefault("initial_lr", group["lr"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as the base optimizer does, keeping each group's decay (also from checkpoints that stored it
        under torch's ``decoupled_weight_decay`` key, which the base class overwrites with True)."""
        decays = []
        for saved, current in zip(state_dict.get("param_groups", []), self.param_groups, strict=False):
            value = saved.get(DECAY_KEY, saved.get(_OLD_KEY))
            decays.append(current[DECAY_KEY] if isinstance(value, bool) or value is None else float(value))
        super().load_state_dict(state_dict)  # type: ignore[misc]
        for group, decay in zip(self.param_groups, decays, strict=False):
            group[DECAY_KEY] = decay

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            decay = group[DECAY_KEY]
            if decay:
                factor = decay * group["lr"] / group["initial_lr"]
                for p in group["params"]:
                    if p.grad is not None:
                        p.mul_(1 - factor)
        return super().step(closure)  # type: ignore[misc]


class DecoupledAdamW(_DecoupledWeightDecay, torch.optim.AdamW):
    """AdamW with weight decay ``weight_decay * lr / initial_lr`` (default ``weight_decay=1e-5``)."""

    def __init__(self, params: Iterable[Any], lr: NonNegativeFloat = 1e-3, betas: tuple[ProperFraction, ProperFraction] = (0.9, 0.95),
                 eps: PositiveFloat = 1e-8, weight_decay: NonNegativeFloat = 1e-5, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=0.0, **kwargs)
        self._take_weight_decay(weight_decay)


class DecoupledSGDW(_DecoupledWeightDecay, torch.optim.SGD):
    """SGD with weight decay ``weight_decay * lr / initial_lr``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, momentum: float = 0.0,
                 weight_decay: float = 0.0, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=0.0, **kwargs)
        self._take_weight_decay(weight_decay)
