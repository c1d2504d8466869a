"""The run's state: what the trainer and every plugin read and change, and what a checkpoint saves."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from smalti.core.data import GLOBAL_POSITION
from smalti.core.errors import TimeError, TrainingError
from smalti.core.rng import load_rng_state_dict, rng_state_dict
from smalti.core.time import Time, Timestamp, TimeUnit

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from smalti.core.evaluator import Evaluator
    from smalti.core.plugins.manager import SmaltiPluginManager


@dataclass(eq=False)
class State:
    """Everything about the run that the loop and plugins share.

    ``model`` is the module the loop calls (wrapped for DDP when that is active); ``raw_model`` is the
    user's module, which carries ``loss``, ``metrics`` and ``flops_per_batch``.
    """

    model: torch.nn.Module
    raw_model: torch.nn.Module
    max_duration: Time
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    train_dataloader: Any = None
    evaluators: list[Evaluator] = field(default_factory=list)
    timestamp: Timestamp = field(default_factory=Timestamp)
    run_name: str = "smalti-run"
    #: The run's folder: every file the run writes (metrics, logs, traces, goodput, checkpoints, exports) goes
    #: under it. ``hydra.run.dir`` under ``smalti-train``, else ``outputs/<run_name>``.
    output_dir: Path = field(default_factory=lambda: Path("outputs") / "smalti-run")
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"
    device_mesh: DeviceMesh | None = None
    rank: int = 0
    world_size: int = 1
    #: Which share of each global batch this rank reads, and how many shares there are: ``rank``/``world_size``
    #: unless ranks share data (a sequence-parallel group reads one share). Set once the model is wrapped.
    dp_rank: int = 0
    dp_world_size: int = 1
    device_train_microbatch_size: int | None = None
    auto_microbatching: bool = False
    grad_scaler: Any = None
    plugin_manager: SmaltiPluginManager | None = None
    config: dict[str, Any] | None = None
    #: Each parameter is stepped inside backward and its gradient freed (``Trainer(optimizer_in_backward=True)``):
    #: after backward no gradient is left for a plugin to read.
    optimizer_in_backward: bool = False

    # Per-step values the hooks read and may change.
    batch: Any = None
    microbatch: Any = None
    microbatch_idx: int = 0
    num_microbatches: int = 0
    outputs: Any = None
    loss: torch.Tensor | None = None
    batch_loss: torch.Tensor | None = None
    batch_num_samples: int = 0
    batch_num_tokens: int = 0
    eval_label: str | None = None
    eval_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    train_metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint_requested: bool = False
    skip_optimizer_step: bool = False
    stop_requested: bool = False
    dataloader_len: int | None = None
    eval_interval: Time | None = None
    last_eval_batch: int = -1

    _loss_read: tuple[torch.Tensor | None, float] = field(default=(None, 0.0), repr=False)

    # ------------------------------------------------------------------ the loss on the host

    def batch_loss_value(self) -> float | None:
        """This step's ``batch_loss`` as a Python float (``None`` before the first step).

        Reading a value on the host waits for the device (a pipeline stall on a GPU): the trainer reads the
        losses once per log interval, and this returns that value without another read when the step is one
        the trainer has just read. Otherwise it reads the loss itself, once per step however often it is asked.
        """
        loss = self.batch_loss
        if loss is None:
            return None
        seen, value = self._loss_read
        if seen is not loss:
            value = float(loss)
            self._loss_read = (loss, value)
        return value

    def remember_batch_loss_value(self, loss: torch.Tensor, value: float) -> None:
        """Record that ``loss`` (a step's ``batch_loss``) was read on the host as ``value``."""
        self._loss_read = (loss, value)

    # ------------------------------------------------------------------ time

    def to_batches(self, time: Time | str) -> int:
        """Convert ``time`` to a number of optimizer steps (needs the epoch length for ``ep`` and ``dur``)."""
        time = Time.from_input(time)
        if time.unit is TimeUnit.BATCH:
            return int(time.value)
        if time.unit is TimeUnit.EPOCH:
            return int(time.value) * self._require_epoch_length(time)
        if time.unit is TimeUnit.DURATION:
            return round(float(time.value) * self.to_batches(self.max_duration)) if self.max_duration.unit is not TimeUnit.DURATION else 0
        per_batch = self.batch_num_samples if time.unit is TimeUnit.SAMPLE else self.batch_num_tokens
        if per_batch <= 0:
            raise TimeError(
                f"cannot convert {time} to batches before the first batch told its size; use 'ba' or 'ep' here"
            )
        return -(-int(time.value) // per_batch)

    def _require_epoch_length(self, time: Time) -> int:
        if not self.dataloader_len:
            raise TimeError(f"{time} needs the train dataloader's length, which it does not report; use 'ba'")
        return self.dataloader_len

    def elapsed_fraction(self) -> float:
        """How much of ``max_duration`` has passed, in [0, 1]."""
        total = self.max_duration
        if total.unit is TimeUnit.DURATION:
            raise TimeError("max_duration cannot be given in 'dur'; use ep, ba, sp or tok")
        count = self.timestamp.get(total.unit)
        if total.unit is TimeUnit.EPOCH and self.dataloader_len:
            count = self.timestamp.batch / self.dataloader_len
        return min(1.0, count / total.value) if total.value else 1.0

    def reached(self, time: Time) -> bool:
        """Whether the run has reached ``time`` (used for ``max_duration``)."""
        if time.unit is TimeUnit.DURATION:
            return self.elapsed_fraction() >= time.value
        return self.timestamp.get(time.unit) >= time.value

    # ------------------------------------------------------------------ state dict

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizers, schedulers, timestamp, RNG, data loader position and every plugin's state."""
        return {
            "model": self.raw_model.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "schedulers": [sched.state_dict() for sched in self.schedulers],
            "timestamp": self.timestamp.state_dict(),
            "rng": rng_state_dict(),
            "dataloader": self.dataloader_state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "device_train_microbatch_size": self.device_train_microbatch_size,
            "run_name": self.run_name,
            "plugins": self.plugin_state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore what :meth:`state_dict` returned; the next batch is the one after the saved one."""
        self.raw_model.load_state_dict(state["model"], strict=strict)
        self.load_training_state_dict(state)

    def load_training_state_dict(self, state: dict[str, Any]) -> None:
        """Restore everything but the model weights (for loaders that restore weights themselves, like DCP)."""
        if len(state.get("optimizers", [])) != len(self.optimizers):
            raise TrainingError(
                f"checkpoint has {len(state['optimizers'])} optimizers but this run has {len(self.optimizers)}"
            )
        for opt, opt_state in zip(self.optimizers, state.get("optimizers", [])):
            opt.load_state_dict(opt_state)
        for sched, sched_state in zip(self.schedulers, state.get("schedulers", [])):
            sched.load_state_dict(sched_state)
        self.timestamp.load_state_dict(state["timestamp"])
        if state.get("rng") is not None:
            load_rng_state_dict(state["rng"])
        if state.get("dataloader") is not None:
            self.load_dataloader_state_dict(state["dataloader"])
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if state.get("device_train_microbatch_size") is not None and self.auto_microbatching:
            self.device_train_microbatch_size = state["device_train_microbatch_size"]
        self.load_plugin_state_dict(state.get("plugins") or {})

    def plugin_state_dict(self) -> dict[str, Any]:
        """Each plugin's ``plugin_state_dict`` result, keyed by its registration name."""
        if self.plugin_manager is None:
            return {}
        out: dict[str, Any] = {}
        for impl in self.plugin_manager.hook.plugin_state_dict.get_hookimpls():
            value = _call_impl(impl, state=self)
            if value is not None:
                out[impl.plugin_name] = value
        return out

    def load_plugin_state_dict(self, saved: dict[str, Any]) -> None:
        """Give each registered plugin the state saved under its name."""
        if self.plugin_manager is None:
            return
        for impl in self.plugin_manager.hook.load_plugin_state_dict.get_hookimpls():
            if impl.plugin_name in saved:
                _call_impl(impl, state=self, plugin_state=saved[impl.plugin_name])

    def dataloader_state_dict(self) -> dict[str, Any] | None:
        """The data loader's own position where it keeps one (stateful loaders, streaming datasets)."""
        loader = self.train_dataloader
        if loader is None:
            return None
        dataset = getattr(loader, "dataset", None)
        if hasattr(loader, "state_dict"):
            saved = {"loader": loader.state_dict()}
        elif dataset is not None and hasattr(dataset, "state_dict"):
            params = inspect.signature(dataset.state_dict).parameters
            if "num_samples" in params:
                saved = {"dataset": dataset.state_dict(num_samples=self.timestamp.sample_in_epoch, from_beginning=True)}
            else:
                saved = {"dataset": dataset.state_dict()}
        else:
            return None
        if getattr(loader, GLOBAL_POSITION, False) is True or getattr(dataset, GLOBAL_POSITION, False) is True:
            saved["global"] = True  # one position for all ranks: a checkpoint may resume on any data-parallel size
        return saved

    def load_dataloader_state_dict(self, saved: dict[str, Any]) -> None:
        loader = self.train_dataloader
        if "loader" in saved and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(saved["loader"])
        elif "dataset" in saved and hasattr(getattr(loader, "dataset", None), "load_state_dict"):
            loader.dataset.load_state_dict(saved["dataset"])


def _call_impl(impl: Any, **kwargs: Any) -> Any:
    return impl.function(*[kwargs[name] for name in impl.argnames])
