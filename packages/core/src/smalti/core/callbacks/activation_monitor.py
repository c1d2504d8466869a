"""Per-layer statistics of activations (max, average, std, ...) at an interval; no hooks in between."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from smalti.core.config.types import TimeOrBatches
from smalti.core.errors import ConfigError
from smalti.core.intervals import batch_count
from smalti.core.plugins import Callback
from smalti.core.time import Time, TimeUnit

#: Statistics a run may ask for, in Composer's key names where Composer has one.
STATS = ("max", "average", "std", "l2_norm", "kurtosis")
#: Per layer, the sums accumulated on the device over the interval step's microbatches (one row each).
_SUMS = ("count", "sum", "sum_sq", "rows", "row_max", "row_l2", "row_kurtosis")


def default_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's top-level children, a ``ModuleList``/``ModuleDict`` child (never called itself) standing for
    its elements: ``embed, blocks.0, blocks.1, norm, head`` for a transformer."""
    layers: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            layers.extend((f"{name}.{sub}", module) for sub, module in child.named_children())
        else:
            layers.append((name, child))
    return layers


def _first_float_tensor(output: Any) -> torch.Tensor | None:
    """The activation a layer's output stands for: the tensor itself, else the first floating-point tensor of a
    tuple, list or dict (a block returning ``(hidden, cache)`` is measured on ``hidden``)."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, Sequence) else ()
    for value in values:
        found = _first_float_tensor(value)
        if found is not None:
            return found
    return None


class ActivationMonitor(Callback):
    """Logs statistics of each layer's output activations on every ``interval``-th batch (a ``ba`` interval).

    Keys, with ``<layer>`` the module's name in the model (``blocks.0``), as Composer's ``ActivationMonitor``
    names them where it has the statistic:

    * ``activations/max/<layer>``: the largest value along the hidden (last) dimension, averaged over the
      other positions (Composer's ``max``);
    * ``activations/average/<layer>``: the mean of all values;
    * ``activations/std/<layer>``: their standard deviation (population, over all values);
    * ``activations/l2_norm/<layer>``: the L2 norm along the hidden dimension, averaged over positions;
    * ``activations/kurtosis/<layer>``: the kurtosis along the hidden dimension, averaged over positions.

    ``stats`` picks which (default ``max``, ``average``, ``std``). Layers: modules whose name matches a glob of
    ``modules`` (``blocks.*``, ``head``) or whose class name is in ``module_types`` (``Block``); with neither,
    the model's top-level children, a ``ModuleList`` standing for its elements (the transformer blocks). A layer
    returning a tuple or dict is measured on its first floating-point tensor.

    Forward hooks are registered before each microbatch's forward on an interval step and removed right after
    it (so backward's recomputation under activation checkpointing is not counted, nor evaluation, nor any
    other step): between intervals the model runs without hooks. The statistics of every microbatch of the
    step are summed on the device into one tensor and read once, at batch end. Values are this rank's.
    """

    def __init__(
        self,
        interval: TimeOrBatches = "25ba",
        stats: Sequence[Literal["max", "average", "std", "l2_norm", "kurtosis"]] = ("max", "average", "std"),
        modules: Sequence[str] | None = None,
        module_types: Sequence[str] | None = None,
    ) -> None:
        self.interval = Time(batch_count(interval, "callbacks.activation_monitor.interval", "25ba"), TimeUnit.BATCH)
        unknown = [s for s in stats if s not in STATS]
        if unknown or not stats:
            raise ConfigError(
                f"callbacks.activation_monitor.stats={list(stats)!r}: choose from {', '.join(STATS)}"
            )
        self.stats = tuple(stats)
        self.modules = tuple(modules or ())
        self.module_types = tuple(module_types or ())
        self._every = int(self.interval.value)
        self._layers: list[tuple[str, nn.Module]] | None = None
        self._handles: list[Any] = []
        self._sums: torch.Tensor | None = None  # [layers, len(_SUMS)], summed over the step's microbatches
        self._due_now = False

    # ------------------------------------------------------------------ choosing layers

    def layers(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs this monitor hooks in ``model``."""
        if not (self.modules or self.module_types):
            return default_layers(model)
        chosen = [
            (name, m)
            for name, m in model.named_modules()
            if name
            and (
                any(fnmatch.fnmatchcase(name, pattern) for pattern in self.modules)
                or type(m).__name__ in self.module_types
            )
        ]
        if not chosen:
            raise ConfigError(
                f"callbacks.activation_monitor: no module of {type(model).__name__} matches modules="
                f"{list(self.modules)} or module_types={list(self.module_types)}; its top-level modules: "
                f"{', '.join(n for n, _ in model.named_children())}"
            )
        return chosen

    # ------------------------------------------------------------------ hooks on interval steps only

    def on_batch_start(self, state: Any) -> None:
        self._due_now = (state.timestamp.batch + 1) % self._every == 0  # the step now running, counted from 1

    def on_before_train_batch(self) -> None:
        if self._due_now:
            self._sums = None  # an out-of-memory retry starts the step's sums again

    def on_before_forward(self, state: Any) -> None:
        if not self._due_now:
            return
        if self._layers is None:
            self._layers = self.layers(state.raw_model)
        if self._sums is None:
            dtype = torch.float32 if state.device.type == "mps" else torch.float64  # MPS has no float64
            self._sums = torch.zeros(len(self._layers), len(_SUMS), dtype=dtype, device=state.device)
        for row, (_, module) in enumerate(self._layers):
            self._handles.append(module.register_forward_hook(self._hook_for(row)))

    def on_after_forward(self) -> None:
        self._remove_hooks()

    def on_exception(self) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook_for(self, row: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensor = _first_float_tensor(output)
            if tensor is not None and tensor.numel() and self._sums is not None:
                with torch.no_grad():
                    self._sums[row] += self._moments(tensor.detach()).to(self._sums.dtype)

        return hook

    def _moments(self, x: torch.Tensor) -> torch.Tensor:
        """This microbatch's sums for one layer, in ``_SUMS`` order (statistics not asked for stay zero)."""
        x = x.float()
        rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
        zero = x.new_zeros(())
        row_max = rows.amax(dim=-1).sum() if "max" in self.stats else zero
        row_l2 = torch.linalg.vector_norm(rows, dim=-1).sum() if "l2_norm" in self.stats else zero
        if "kurtosis" in self.stats:
            centred = rows - rows.mean(dim=-1, keepdim=True)
            var = centred.square().mean(dim=-1)
            row_kurtosis = (centred.pow(4).mean(dim=-1) / var.square()).sum()
        else:
            row_kurtosis = zero
        return torch.stack(
            [
                x.new_tensor(float(x.numel())),
                x.sum(),
                x.square().sum(),
                x.new_tensor(float(rows.shape[0])),
                row_max,
                row_l2,
                row_kurtosis,
            ]
        )

    # ------------------------------------------------------------------ one read per interval

    def on_batch_end(self, logger: Any) -> None:
        if not self._due_now or self._sums is None or self._layers is None:
            return
        self._due_now = False
        sums, self._sums = self._sums, None
        metrics: dict[str, float] = {}
        for (name, _), row in zip(self._layers, sums.tolist()):  # the one read of this interval
            s = dict(zip(_SUMS, row))
            if not s["count"]:
                continue
            mean = s["sum"] / s["count"]
            values = {
                "max": s["row_max"] / s["rows"],
                "average": mean,
                "std": max(0.0, s["sum_sq"] / s["count"] - mean * mean) ** 0.5,
                "l2_norm": s["row_l2"] / s["rows"],
                "kurtosis": s["row_kurtosis"] / s["rows"],
            }
            for stat in self.stats:
                metrics[f"activations/{stat}/{name}"] = values[stat]
        if metrics:
            logger.log_metrics(metrics)
