"""Progressive layer freezing: the earliest layers stop training, more of them as training goes on."""

from __future__ import annotations

import math
from typing import Any

import torch

from smalti.core.config.types import Probability, TimeOrFraction
from smalti.core.errors import ConfigError, TimeError
from smalti.core.plugins import Algorithm
from smalti.core.time import Time


def layers_of(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """The model's layers in forward order as they are registered: each module that holds parameters itself."""
    out = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own:
            out.append((name, own))
    return out


class LayerFreezing(Algorithm):
    """From ``freeze_start`` on, freezes the earliest layers; the frozen share grows linearly to
    ``freeze_level`` at the end of training (Composer's LayerFreezing, by time instead of epochs).

    A layer is a module holding parameters of its own, in registration order. After step ``t`` of ``T``
    the first ``floor(freeze_level * (t - start) / (T - start) * layers)`` layers are frozen. A frozen
    layer's gradients are dropped before the optimizer step (``on_after_train_batch``, so list this before
    ``gradient_clipping`` to leave them out of the norm): the optimizer skips parameters without a gradient,
    so frozen weights stay bit-identical, weight decay included, and their optimizer state is kept as it was
    (``drop_optimizer_state`` frees it instead: the memory comes back, and a layer never thaws). The frozen
    layers still run backward (it saves no compute; the optimizer update is what is skipped). Logs
    ``layer_freezing/frozen_layers`` and ``layer_freezing/frozen_fraction`` when they change. The count is
    a function of the step, so a resumed run freezes the same layers.
    """

    def __init__(self, freeze_start: TimeOrFraction = "0.5dur", freeze_level: Probability = 1.0,
                 drop_optimizer_state: bool = False) -> None:
        if not 0.0 <= freeze_level <= 1.0:
            raise ConfigError(f"algorithms.layer_freezing.freeze_level={freeze_level} must be in [0, 1]")
        try:
            self.freeze_start = Time.from_input(freeze_start, "dur")
        except TimeError as exc:
            raise ConfigError(f"algorithms.layer_freezing.freeze_start={freeze_start!r}: {exc}") from None
        self.freeze_level = float(freeze_level)
        self.drop_optimizer_state = drop_optimizer_state
        self._layers: list[tuple[str, list[torch.nn.Parameter]]] = []
        self._logged = -1

    def frozen_count(self, state: Any, step: int) -> int:
        """How many of the earliest layers are frozen for the step that makes the count ``step``."""
        total = state.to_batches(state.max_duration)
        start = state.to_batches(self.freeze_start)
        if step <= start or total <= start:
            return 0
        fraction = min(1.0, (step - start) / (total - start)) * self.freeze_level
        return math.floor(fraction * len(self._layers) + 1e-9)

    def on_fit_start(self, state: Any) -> None:
        self._layers = layers_of(state.raw_model)

    def on_after_train_batch(self, state: Any, logger: Any) -> None:
        count = self.frozen_count(state, state.timestamp.batch + 1)
        frozen = [p for _, params in self._layers[:count] for p in params]
        for p in frozen:
            p.grad = None
        if self.drop_optimizer_state and count:
            frozen_ids = {id(p) for p in frozen}
            for opt in state.optimizers:
                for p in [p for p in opt.state if id(p) in frozen_ids]:
                    del opt.state[p]
        if count != self._logged:
            self._logged = count
            logger.log_metrics({"layer_freezing/frozen_layers": float(count),
                                "layer_freezing/frozen_fraction": count / max(1, len(self._layers))},
                               step=state.timestamp.batch + 1)
