"""Stochastic weight averaging (SWA, Izmailov et al. 2018): the mean of the weights late in training, with its own LR."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.optim.swa_utils import SWALR, get_swa_multi_avg_fn

from smalti.core._compat import BatchNorm, foreach_copy_
from smalti.core.config.types import NonNegativeFloat, NonNegativeInt, TimeOrBatches
from smalti.core.errors import ConfigError, TimeError, TrainingError
from smalti.core.plugins import Algorithm
from smalti.core.tensors import copy_saved_tensors, local_shard, weights_and_float_buffers
from smalti.core.time import Time


def _time(value: str | int, key: str, default_unit: str) -> Time:
    try:
        return Time.from_input(value, default_unit)
    except TimeError as exc:
        raise ConfigError(f"algorithms.swa.{key}={value!r}: {exc}") from None


class SWA(Algorithm):
    """Averages the weights from ``swa_start`` on, every ``update_interval``; the average is what is evaluated.

    At the step that ends at ``swa_start`` (any time unit: ``"0.7dur"``, ``"100ba"``, ``"2ep"``) the weights are
    the first snapshot; then one more every ``update_interval`` (``"1ep"``, ``"5ba"``); the average is their plain
    mean (``torch.optim.swa_utils``' averaging function, run on each rank's shards, so FSDP2 works). Parameters
    and floating-point buffers are averaged.

    With ``swa_lr`` set, the LR is SWA's own from ``swa_start`` on: ``torch.optim.swa_utils.SWALR`` anneals it
    from the LR in effect at ``swa_start`` to ``swa_lr`` over ``anneal_steps`` snapshots (``anneal_strategy``
    ``cos`` or ``linear``) and holds it there; the trainer's schedulers keep counting but no longer set the LR.
    With ``swa_lr: null`` the trainer's schedule goes on.

    The average replaces the model's weights for every evaluation and, with ``swap_at_fit_end``, for good at fit
    end (the final checkpoint then holds it). A model with batch norm gets its running statistics recomputed for
    the averaged weights first, from ``bn_update_batches`` batches of the train data loader (0: keep the
    averaged statistics); the data loader's position and the RNG are left as they were. The average, the
    snapshot count and the LR schedule's position are saved in checkpoints and restored on resume. Logs
    ``swa/n_averaged`` and ``swa/lr`` (the LR of the steps that follow) at each snapshot.
    """

    def __init__(
        self,
        swa_start: TimeOrBatches = "0.7dur",
        update_interval: TimeOrBatches = "1ep",
        swa_lr: NonNegativeFloat | None = None,
        anneal_steps: NonNegativeInt = 10,
        anneal_strategy: Literal["cos", "linear"] = "cos",
        swap_at_fit_end: bool = True,
        bn_update_batches: NonNegativeInt = 16,
    ) -> None:
        self.swa_start = _time(swa_start, "swa_start", "dur")
        self.update_interval = _time(update_interval, "update_interval", "ba")
        if swa_lr is not None and not swa_lr >= 0:
            raise ConfigError(
                f"algorithms.swa.swa_lr={swa_lr} must be >= 0 (or null to keep the trainer's schedule)"
            )
        if anneal_steps < 0:
            raise ConfigError(f"algorithms.swa.anneal_steps={anneal_steps} must be >= 0")
        if anneal_strategy not in ("cos", "linear"):
            raise ConfigError(f"algorithms.swa.anneal_strategy={anneal_strategy!r} must be 'cos' or 'linear'")
        if bn_update_batches < 0:
            raise ConfigError(f"algorithms.swa.bn_update_batches={bn_update_batches} must be >= 0")
        self.swa_lr = swa_lr
        self.anneal_steps = int(anneal_steps)
        self.anneal_strategy = anneal_strategy
        self.swap_at_fit_end = swap_at_fit_end
        self.bn_update_batches = int(bn_update_batches)
        self.average: dict[str, torch.Tensor] = {}
        self.n_averaged = 0
        self.schedulers: list[SWALR] = []
        self._avg_fn = get_swa_multi_avg_fn()
        self._live: list[torch.Tensor] = []
        self._avg: list[torch.Tensor] = []
        self._backup: list[torch.Tensor] | None = None
        self._pending: dict[str, Any] | None = None
        self._start = self._every = 0

    # ------------------------------------------------------------------ set-up

    def on_fit_start(self, state: Any) -> None:
        named = weights_and_float_buffers(state.raw_model)
        if set(self.average) != set(named):
            self.average = {k: t.detach().clone() for k, t in named.items()}
            self.n_averaged = 0
        self._live = [local_shard(t.detach()) for t in named.values()]
        self._avg = [local_shard(self.average[k]) for k in named]
        self._start = state.to_batches(self.swa_start)
        self._every = max(1, state.to_batches(self.update_interval))
        if self._pending is not None:
            self._apply_loaded(state, self._pending)
            self._pending = None

    # ------------------------------------------------------------------ averaging and the LR

    def _make_schedulers(self, state: Any) -> None:
        assert self.swa_lr is not None
        self.schedulers = [
            SWALR(
                opt, swa_lr=self.swa_lr, anneal_epochs=self.anneal_steps, anneal_strategy=self.anneal_strategy
            )
            for opt in state.optimizers
        ]

    def _hold_lr(self) -> None:
        """Put SWA's LR back in every param group (the trainer's schedulers stepped just before)."""
        for sched in self.schedulers:
            for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
                group["lr"] = lr

    @torch.no_grad()
    def on_after_optimizer_step(self, state: Any, logger: Any) -> None:
        if state.skip_optimizer_step:
            self._hold_lr()
            return
        step = state.timestamp.batch + 1  # the step that just ran; the timestamp counts it after this hook
        if step < self._start or (step - self._start) % self._every:
            self._hold_lr()
            return
        if self.n_averaged == 0:
            foreach_copy_(self._avg, self._live)
        else:
            self._avg_fn(self._avg, self._live, self.n_averaged)  # a host int: no device read
        self.n_averaged += 1
        if self.swa_lr is not None:
            if not self.schedulers:
                self._make_schedulers(state)
            else:
                self._hold_lr()  # SWALR reads the LR it last set back from the param groups
                for sched in self.schedulers:
                    sched.step()
        self._hold_lr()
        lr = state.optimizers[0].param_groups[0]["lr"] if state.optimizers else 0.0
        logger.log_metrics({"swa/n_averaged": float(self.n_averaged), "swa/lr": float(lr)}, step=step)

    # ------------------------------------------------------------------ the average in the model

    @torch.no_grad()
    def _swap_in(self, state: Any) -> None:
        self._backup = [t.clone() for t in self._live]
        foreach_copy_(self._live, self._avg)
        self._update_bn(state)

    @torch.no_grad()
    def _swap_out(self) -> None:
        if self._backup is not None:
            foreach_copy_(self._live, self._backup)
            self._backup = None

    @torch.no_grad()
    def _update_bn(self, state: Any) -> None:
        """Recompute batch-norm running statistics for the weights now in the model (``swa_utils.update_bn``'s way)."""
        norms = [
            m
            for m in state.raw_model.modules()
            if isinstance(m, BatchNorm) and m.track_running_stats
        ]
        if not norms or not self.bn_update_batches or state.train_dataloader is None:
            return
        from smalti.core.batching import move_to_device

        momenta = {m: m.momentum for m in norms}
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative mean over the batches
        was_training = state.model.training
        saved_position = state.dataloader_state_dict()
        state.model.train()
        try:
            with torch.random.fork_rng(devices=[state.device] if state.device.type == "cuda" else []):
                for i, batch in enumerate(state.train_dataloader):
                    if i >= self.bn_update_batches:
                        break
                    state.model(move_to_device(batch, state.device))
        finally:
            for m, momentum in momenta.items():
                m.momentum = momentum
            state.model.train(was_training)
            if saved_position is not None:
                state.load_dataloader_state_dict(saved_position)

    def on_eval_before_all(self, state: Any) -> None:
        if self.n_averaged:
            self._swap_in(state)

    def on_eval_after_all(self) -> None:
        self._swap_out()

    @torch.no_grad()
    def on_fit_end(self, state: Any) -> None:
        if self.swap_at_fit_end and self.n_averaged:
            foreach_copy_(self._live, self._avg)
            self._update_bn(state)

    # ------------------------------------------------------------------ resumable state

    def plugin_state_dict(self) -> dict[str, Any]:
        return {
            "average": dict(self.average),
            "n_averaged": self.n_averaged,
            # SWALR's own state_dict holds its anneal function, which a weights-only load refuses: its counters only
            "lr_schedule": [
                {"step_count": s._step_count, "last_epoch": s.last_epoch, "last_lr": list(s.get_last_lr())}
                for s in self.schedulers
            ],
        }

    def load_plugin_state_dict(self, state: Any, plugin_state: dict[str, Any]) -> None:
        if self._avg:
            self._apply_loaded(state, plugin_state)
        else:  # loaded before fit: the average is built on the model's device at fit start
            self._pending = plugin_state

    @torch.no_grad()
    def _apply_loaded(self, state: Any, plugin_state: dict[str, Any]) -> None:
        copy_saved_tensors(self.average, plugin_state["average"], "SWA state", "algorithms.swa")
        self.n_averaged = int(plugin_state["n_averaged"])
        schedule = plugin_state.get("lr_schedule") or []
        self.schedulers = []
        if schedule and self.swa_lr is not None:
            if len(schedule) != len(state.optimizers):
                raise TrainingError(
                    f"SWA's LR schedule in the checkpoint is for {len(schedule)} optimizers, this run has "
                    f"{len(state.optimizers)}"
                )
            self._make_schedulers(state)
            for sched, saved_sched in zip(self.schedulers, schedule):
                sched._step_count = saved_sched["step_count"]
                sched.last_epoch = saved_sched["last_epoch"]
                sched._last_lr = list(saved_sched["last_lr"])
            self._hold_lr()
