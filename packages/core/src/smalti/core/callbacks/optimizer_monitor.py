"""L2 norms of gradients, weights, optimizer moments and updates, per parameter and global, at an interval."""

from __future__ import annotations

from typing import Any

import torch

from smalti.core.config.types import TimeOrBatches
from smalti.core.intervals import batch_count
from smalti.core.plugins import Callback
from smalti.core.tensors import local_shard
from smalti.core.time import Time, TimeUnit

#: Optimizer-state keys read as the first moment (Adam's ``exp_avg``, SGD's momentum buffer) and the second.
_FIRST_MOMENT = ("exp_avg", "momentum_buffer")
_SECOND_MOMENT = ("exp_avg_sq",)



def _shard_groups(tensor: torch.Tensor) -> tuple[Any, ...]:
    """The process groups over which ``tensor``'s shards must be summed: a DTensor's ``Shard`` mesh dims, else none."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return ()
    mesh = tensor.device_mesh
    return tuple(mesh.get_group(dim) for dim, p in enumerate(placements) if p.is_shard())


class OptimizerMonitor(Callback):
    """Logs Composer's optimizer metrics every ``interval`` batches (a ``ba`` interval); nothing in between.

    Keys, with ``<name>`` each parameter's name in the model (``blocks.0.0.weight``):

    * ``l2_norm/grad/global`` and ``l2_norm/grad/<name>``: gradients as the optimizer uses them (after
      unscaling and clipping, averaged over data-parallel ranks);
    * ``l2_norm/param/<name>``: the weights after the step;
    * ``l2_norm/moment/<name>``: the first moment (Adam's ``exp_avg``, SGD's momentum buffer);
      ``l2_norm/second_moment_sqrt/<name>``: ``sqrt`` of Adam's ``exp_avg_sq``;
    * ``l2_norm/update/<name>`` and ``l2_norm_ratio/update_param/<name>``: the step's change of the weights
      and its norm over the weights' norm before the step.

    Between intervals no hook does any tensor work. At an interval step every norm is computed on the
    device into one tensor (the weights are copied before the step to measure the update); sharded
    (FSDP2) parameters' partial sums go through one ``all_reduce``; the host reads the values once, at
    batch end, where the trainer already waits for the step. ``per_layer=False`` logs the global norm only.
    """

    #: Why ``trainer.optimizer_in_backward=true`` refuses this callback.
    optimizer_in_backward_conflict = (
        "it reads every gradient before the optimizer step, but the step in backward has already used and freed "
        "them (the global gradient norm needs all of them at once)"
    )

    def __init__(self, interval: TimeOrBatches = "10ba", per_layer: bool = True) -> None:
        self.interval = Time(batch_count(interval, "callbacks.optimizer_monitor.interval"), TimeUnit.BATCH)
        self.per_layer = per_layer
        self._every = int(self.interval.value)
        self._names: dict[int, str] = {}
        self._before: dict[int, torch.Tensor] = {}
        self._grad_sq: dict[int, torch.Tensor] = {}
        self._pending: tuple[list[str], torch.Tensor] | None = None

    def _due(self, state: Any) -> bool:
        return (state.timestamp.batch + 1) % self._every == 0  # the step now running, counted from 1

    def _params(self, state: Any) -> list[tuple[str, torch.Tensor]]:
        if not self._names:
            self._names = {id(p): n for n, p in state.raw_model.named_parameters()}
        return [(self._names.get(id(p), f"param{i}"), p)
                for opt in state.optimizers for group in opt.param_groups for i, p in enumerate(group["params"])]

    def on_before_optimizer_step(self, state: Any) -> None:
        if self._due(state):
            with torch.no_grad():
                self._take_grads(state)

    def _take_grads(self, state: Any) -> None:
        self._before, self._grad_sq = {}, {}
        for _, p in self._params(state):
            if p.grad is not None:
                self._grad_sq[id(p)] = local_shard(p.grad).detach().float().square().sum()
            if self.per_layer:
                self._before[id(p)] = local_shard(p).detach().clone()

    def on_after_optimizer_step(self, state: Any) -> None:
        if self._before or self._grad_sq:
            with torch.no_grad():
                self._measure(state)

    def _measure(self, state: Any) -> None:
        names: list[str] = []
        sums: list[torch.Tensor] = []
        groups: list[tuple[Any, ...]] = []
        states = {id(p): s for opt in state.optimizers for p, s in opt.state.items()}
        for name, p in self._params(state):
            key = id(p)
            entries: list[tuple[str, torch.Tensor]] = []
            if key in self._grad_sq:
                entries.append((f"l2_norm/grad/{name}", self._grad_sq[key]))
            if self.per_layer:
                local = local_shard(p).detach().float()
                entries.append((f"l2_norm/param/{name}", local.square().sum()))
                before = self._before.get(key)
                if before is not None:
                    entries.append((f"/before/{name}", before.float().square().sum()))
                    entries.append((f"l2_norm/update/{name}", (local - before.float()).square().sum()))
                opt_state = states.get(key, {})
                for k in _FIRST_MOMENT:
                    if isinstance(opt_state.get(k), torch.Tensor):
                        entries.append((f"l2_norm/moment/{name}", local_shard(opt_state[k]).float().square().sum()))
                        break
                for k in _SECOND_MOMENT:
                    if isinstance(opt_state.get(k), torch.Tensor):  # ||sqrt(v)||^2 = sum(v)
                        entries.append((f"l2_norm/second_moment_sqrt/{name}", local_shard(opt_state[k]).float().sum()))
            shards = _shard_groups(p)
            for metric, value in entries:
                names.append(metric)
                sums.append(value)
                groups.append(shards)
        self._before, self._grad_sq = {}, {}
        if not sums:
            return
        stacked = self._reduce_shards(torch.stack(sums), groups)
        grads = [i for i, n in enumerate(names) if n.startswith("l2_norm/grad/")]
        if grads:
            names.append("l2_norm/grad/global")
            stacked = torch.cat([stacked, stacked[grads].sum().reshape(1)])
        self._pending = (names, stacked.sqrt())

    @staticmethod
    def _reduce_shards(stacked: torch.Tensor, groups: list[tuple[Any, ...]]) -> torch.Tensor:
        """Sum each entry's partial sums over the ranks holding its shards: one ``all_reduce`` per distinct group."""
        distinct = {g for g in groups if g}
        if not distinct:
            return stacked
        import torch.distributed as dist

        for key in distinct:
            mask = torch.tensor([g == key for g in groups], device=stacked.device)
            part = torch.where(mask, stacked, torch.zeros_like(stacked))
            for group in key:
                dist.all_reduce(part, group=group)
            stacked = torch.where(mask, part, stacked)
        return stacked

    def on_batch_end(self, logger: Any) -> None:
        if self._pending is None:
            return
        names, norms = self._pending
        self._pending = None
        values = dict(zip(names, norms.tolist()))  # the one read of this interval
        metrics: dict[str, float] = {}
        for name, value in values.items():
            if name.startswith("/before/"):
                continue
            if name.startswith("l2_norm/update/"):
                layer = name.removeprefix("l2_norm/update/")
                before = values.get(f"/before/{layer}", 0.0)
                if before > 0:
                    metrics[f"l2_norm_ratio/update_param/{layer}"] = value / before
            if self.per_layer or name == "l2_norm/grad/global":
                metrics[name] = value
        logger.log_metrics(metrics)
