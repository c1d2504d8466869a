"""Exponential moving average of the weights, used for evaluation and optionally kept at the end."""

from __future__ import annotations

from typing import Any

import torch

from smalti.core.errors import ConfigError
from smalti.core.plugins import Algorithm
from smalti.core.time import Time


class EMA(Algorithm):
    """Keeps ``ema = s * ema + (1 - s) * weights`` every ``update_interval`` from ``ema_start`` on.

    ``s = 2 ** -(update_interval / half_life)`` (both in batches), or give ``smoothing`` directly. The EMA
    weights replace the model's during evaluation; ``swap_at_fit_end`` leaves them in the model at the end.
    """

    def __init__(self, half_life: str | None = "100ba", smoothing: float | None = None, update_interval: str = "1ba",
                 ema_start: str = "0ba", swap_at_fit_end: bool = False) -> None:
        if (half_life is None) == (smoothing is None):
            raise ConfigError("algorithms.ema: give exactly one of half_life and smoothing")
        self.update_interval = Time.from_input(update_interval, "ba")
        self.ema_start = Time.from_input(ema_start, "ba")
        self.half_life = Time.from_input(half_life, "ba") if half_life is not None else None
        self.smoothing = smoothing
        self.swap_at_fit_end = swap_at_fit_end
        self.shadow: dict[str, torch.Tensor] = {}

    def _tensors(self, state: Any) -> dict[str, torch.Tensor]:
        named = dict(state.raw_model.named_parameters())
        named.update({k: b for k, b in state.raw_model.named_buffers() if b.is_floating_point()})
        return named

    def _smoothing(self, state: Any) -> float:
        if self.smoothing is not None:
            return self.smoothing
        return 2.0 ** -(state.to_batches(self.update_interval) / state.to_batches(self.half_life))

    def on_fit_start(self, state: Any) -> None:
        if not self.shadow:
            self.shadow = {k: t.detach().clone() for k, t in self._tensors(state).items()}

    @torch.no_grad()
    def on_after_optimizer_step(self, state: Any) -> None:
        step = state.timestamp.batch + 1  # the batch that just stepped
        if step < state.to_batches(self.ema_start) or step % state.to_batches(self.update_interval):
            return
        s = self._smoothing(state)
        for name, tensor in self._tensors(state).items():
            self.shadow[name].mul_(s).add_(tensor.detach(), alpha=1 - s)

    @torch.no_grad()
    def _swap(self, state: Any) -> None:
        for name, tensor in self._tensors(state).items():
            tmp = tensor.detach().clone()
            tensor.copy_(self.shadow[name])
            self.shadow[name].copy_(tmp)

    def on_eval_before_all(self, state: Any) -> None:
        self._swap(state)

    def on_eval_after_all(self, state: Any) -> None:
        self._swap(state)

    def on_fit_end(self, state: Any) -> None:
        if self.swap_at_fit_end:
            self._swap(state)

    def plugin_state_dict(self) -> dict[str, Any]:
        return {"shadow": {k: v.clone() for k, v in self.shadow.items()}}

    def load_plugin_state_dict(self, plugin_state: dict[str, Any]) -> None:
        self.shadow = {k: v.clone() for k, v in plugin_state["shadow"].items()}
