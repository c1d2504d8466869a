"""Exponential moving average (EMA) of the weights, used for evaluation and optionally kept at the end."""

from __future__ import annotations

from typing import Any

import torch

from smalti.core._compat import foreach_copy_, foreach_lerp_
from smalti.core.config.types import ProperFraction, TimeOrBatches
from smalti.core.errors import ConfigError
from smalti.core.plugins import Algorithm
from smalti.core.tensors import copy_saved_tensors, local_shard, weights_and_float_buffers
from smalti.core.time import Time


class EMA(Algorithm):
    """Keeps ``ema = s * ema + (1 - s) * weights`` after every ``update_interval`` optimizer steps.

    ``s = 2 ** -(update_interval / half_life)`` (both converted to batches), or give ``smoothing`` itself.
    Parameters and floating-point buffers are averaged; the shadow copy lives on the model's device with
    the same sharding. Averaging starts at ``ema_start``: the shadow is set to the weights then, and until
    then evaluation uses the live weights. From then on the EMA weights replace the model's for every
    evaluation round; ``swap_at_fit_end`` leaves them in the model when training ends (the live weights
    are then in the shadow). Steps skipped by ``state.skip_optimizer_step`` do not update the average.
    """

    def __init__(self, half_life: TimeOrBatches | None = "100ba", smoothing: ProperFraction | None = None,
                 update_interval: TimeOrBatches = "1ba", ema_start: TimeOrBatches = "0ba",
                 swap_at_fit_end: bool = False) -> None:
        if (half_life is None) == (smoothing is None):
            raise ConfigError(
                f"algorithms.ema: give exactly one of half_life and smoothing (got half_life={half_life!r}, "
                f"smoothing={smoothing!r}); set the other to null"
            )
        if smoothing is not None and not 0.0 <= smoothing < 1.0:
            raise ConfigError(f"algorithms.ema.smoothing={smoothing} must be in [0, 1)")
        self.half_life = Time.from_input(half_life, "ba") if half_life is not None else None
        self.smoothing = smoothing
        self.update_interval = Time.from_input(update_interval, "ba")
        self.ema_start = Time.from_input(ema_start, "ba")
        self.swap_at_fit_end = swap_at_fit_end
        self.shadow: dict[str, torch.Tensor] = {}
        self.started = False
        self._pending: dict[str, Any] | None = None
        self._live: list[torch.Tensor] = []
        self._avg: list[torch.Tensor] = []
        self._s: float | None = None
        self._interval = self._start = 0

    # ------------------------------------------------------------------ set-up

    def on_fit_start(self, state: Any) -> None:
        named = weights_and_float_buffers(state.raw_model)
        if set(self.shadow) != set(named):
            self.shadow = {k: t.detach().clone() for k, t in named.items()}
            self.started = False
        self._live = [local_shard(t.detach()) for t in named.values()]
        self._avg = [local_shard(self.shadow[k]) for k in named]
        self._interval = max(1, state.to_batches(self.update_interval))
        self._start = state.to_batches(self.ema_start)
        self._s = None
        if self._pending is not None:
            self._apply_loaded(self._pending)
            self._pending = None
        elif self._start == 0:
            self.started = True  # the average starts from the initial weights

    def smoothing_per_update(self, state: Any) -> float:
        """The factor ``s`` applied at each update: ``smoothing``, or ``2 ** -(update_interval / half_life)``."""
        if self.smoothing is not None:
            return self.smoothing
        half_life = state.to_batches(self.half_life)
        if half_life <= 0:
            raise ConfigError(f"algorithms.ema.half_life={self.half_life} must be longer than 0 batches")
        return 2.0 ** -(state.to_batches(self.update_interval) / half_life)

    # ------------------------------------------------------------------ averaging

    @torch.no_grad()
    def on_after_optimizer_step(self, state: Any) -> None:
        if state.skip_optimizer_step or not self._avg:
            return
        step = state.timestamp.batch + 1  # the step that just ran; the timestamp counts it after this hook
        if step < self._start:
            return
        if not self.started:
            foreach_copy_(self._avg, self._live)
            self.started = True
            return
        if step % self._interval:
            return
        if self._s is None:  # converted late: half-lives in samples or tokens need a batch's size first
            self._s = self.smoothing_per_update(state)
        foreach_lerp_(self._avg, self._live, 1.0 - self._s)

    @torch.no_grad()
    def _swap(self) -> None:
        for live, avg in zip(self._live, self._avg):
            scratch = live.clone()
            live.copy_(avg)
            avg.copy_(scratch)

    def on_eval_before_all(self) -> None:
        if self.started:
            self._swap()

    def on_eval_after_all(self) -> None:
        if self.started:
            self._swap()

    def on_fit_end(self) -> None:
        if self.swap_at_fit_end and self.started:
            self._swap()

    # ------------------------------------------------------------------ resumable state

    def plugin_state_dict(self) -> dict[str, Any]:
        return {"shadow": dict(self.shadow), "started": self.started}

    def load_plugin_state_dict(self, plugin_state: dict[str, Any]) -> None:
        if self._avg:
            self._apply_loaded(plugin_state)
        else:  # loaded before fit: the shadow is built on the model's device at fit start
            self._pending = plugin_state

    @torch.no_grad()
    def _apply_loaded(self, plugin_state: dict[str, Any]) -> None:
        copy_saved_tensors(self.shadow, plugin_state["shadow"], "EMA state", "algorithms.ema")
        self.started = bool(plugin_state.get("started", True))
