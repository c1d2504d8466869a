"""The training loop. ``Trainer.fit()`` runs it; ``train_step`` and ``forward_backward`` are public and overridable.

Behaviour is added through plugins (algorithms, callbacks, loggers and installed packages) that implement
the hooks in :mod:`smalti.core.plugins.hookspecs`; the trainer calls them in the documented order.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smalti.core import distributed
from smalti.core.batching import batch_size_of, move_to_device, num_tokens_of, split_batch
from smalti.core.callbacks.progress_bar import ProgressBar
from smalti.core.cpu_gemm import configure_cpu_gemm
from smalti.core.cpu_malloc import DEFAULT_MMAP_THRESHOLD, configure_cpu_malloc
from smalti.core.data import no_batch_message, seed_data_loading
from smalti.core.errors import ConfigError, TrainingError
from smalti.core.evaluator import Evaluator
from smalti.core.events import Event, Events
from smalti.core.intervals import interval_fires
from smalti.core.logger import Logger
from smalti.core.optim import DecoupledAdamW, OptimizerInBackward, Schedule
from smalti.core.optim.in_backward_checks import (
    check_optimizer_in_backward,
    refuse_microbatches,
    refuse_skipped_step,
)
from smalti.core.optim.row_sparse import (
    begin_sparse_grads,
    end_sparse_grads,
    settle_sparse_grads,
    step_sparse_params,
)
from smalti.core.parallelism import DDP, Parallelism, SingleDevice
from smalti.core.plugin import should_eval as default_should_eval
from smalti.core.plugins.manager import SmaltiPluginManager, new_plugin_manager
from smalti.core.precision import autocast, check_precision, make_grad_scaler
from smalti.core.seed import configure_determinism, seed_all
from smalti.core.state import State
from smalti.core.time import Time, TimeUnit

log = logging.getLogger(__name__)

PluginSpec = Mapping[str, Any] | Iterable[Any] | None
OptimizerSpec = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | list[Any] | None


def _with_float8(algorithms: dict[str, Any], precision: str) -> dict[str, Any]:
    """``algorithms``, with :class:`~smalti.core.algorithms.Float8Training` at its defaults added for ``amp_fp8``."""
    if precision != "amp_fp8":
        return algorithms
    from smalti.core.algorithms.float8 import Float8Training

    if any(isinstance(a, Float8Training) for a in algorithms.values()):
        return algorithms
    return {"float8": Float8Training(), **algorithms}


def _named(objects: PluginSpec) -> dict[str, Any]:
    """Plugins as ``name -> object``; a list gets names from the class names."""
    if objects is None:
        return {}
    if isinstance(objects, Mapping):
        return {str(k): v for k, v in objects.items() if v is not None}
    named: dict[str, Any] = {}
    for obj in objects:
        base = type(obj).__name__.lower()
        name, i = base, 1
        while name in named:
            i += 1
            name = f"{base}-{i}"
        named[name] = obj
    return named


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(getattr(model, "loss", None)):
        raise ConfigError(
            f"model {type(model).__name__} has no loss(outputs, batch) method; smalti models implement "
            "forward(batch) and loss(outputs, batch) (see smalti.core.model.SmaltiModel)"
        )


class Trainer:
    """Train ``model`` on ``train_dataloader`` for ``max_duration`` with the given plugins.

    Args:
        model: an ``nn.Module`` with ``forward(batch)`` and ``loss(outputs, batch)``; optionally
            ``eval_forward(batch)``, ``metrics(train: bool)``, ``update_metric(batch, outputs, metric)``,
            ``flops_per_batch(batch)`` and ``num_tokens(batch)``.
        train_dataloader: yields this rank's batches (one batch per optimizer step).
        max_duration: when to stop: ``"2ep"``, ``"1000ba"``, ``"1e9tok"``, ...
        optimizers: an optimizer, or a factory ``f(params)`` (needed with FSDP, which replaces the parameters);
            default :class:`DecoupledAdamW` at ``lr=1e-3``.
        schedulers: :class:`Schedule` objects (warmup in Time units) or ready ``LRScheduler`` objects.
        eval_dataloader: a dataloader, an :class:`Evaluator` or a list of them.
        eval_interval: how often to evaluate (``"1ep"``, ``"500ba"``, ``"0.25dur"``).
        algorithms, callbacks, loggers: plugins for this run, as ``name -> object`` or a list. ``loggers=None``
            (the default) logs as ``smalti-train`` does: a :class:`ConsoleLogger` every ``10ba`` and a
            :class:`JSONLLogger` writing ``<output_dir>/metrics.jsonl``; ``loggers=[]`` logs nowhere.
        progress_bar: add a :class:`~smalti.core.callbacks.ProgressBar` (drawn on rank 0 when stdout is a
            terminal) unless ``callbacks`` already holds one; ``False`` for none.
        output_dir: the run's folder (``state.output_dir``): the default ``metrics.jsonl`` and every callback's
            default file (traces, goodput, exports) go under it; default ``outputs/<run_name>`` (as
            ``smalti-train``), and then ``outputs/latest`` points at it.
        device_train_microbatch_size: samples per microbatch (gradient accumulation), ``"auto"`` to halve on
            out-of-memory, or ``None`` for the whole batch at once.
        precision: ``fp32``, ``amp_bf16``, ``amp_fp16`` or ``amp_fp8`` (bf16 autocast with the linear layers in
            float8 through :class:`~smalti.core.algorithms.Float8Training`, added at its defaults unless given).
        parallelism: a :class:`Parallelism`; default ``single`` on one rank, ``ddp`` under a multi-rank launch.
        compile: wrap the model's forward with ``torch.compile``.
        config: the run's resolved config, sent to ``log_hyperparameters`` and checked equal across ranks.
        load_state: a :meth:`State.state_dict` to resume from.
        log_interval: how often the step losses are read from the device and logged (``"10ba"``, ...). Each
            step's ``loss/train/total`` is logged with its own step number, in one transfer per interval, so
            the steps in between never wait for the device. Default: the finest ``log_interval`` of the
            loggers that print at one (the console logger's), else ``10ba``. The losses are also read before
            a checkpoint, at the end of the run and when it fails.
        deterministic: bit-reproducible runs (:func:`smalti.core.seed.configure_determinism`): deterministic
            algorithms only, the cuBLAS workspace setting on GPU, a fixed number of CPU threads.
        optimizer_in_backward: step each parameter's optimizer inside backward, as soon as its gradient is
            complete, and free that gradient (:class:`~smalti.core.optim.OptimizerInBackward`): the step never
            holds every gradient at once. The configured optimizer stays the one schedulers, loggers and
            checkpoints see. Refused, naming the key, with what needs all gradients at once: gradient
            accumulation (more than one microbatch, ``"auto"``), ``amp_fp16``'s grad scaler, DDP, and plugins
            that read or change the gradients between backward and step (gradient clipping, SAM, the
            optimizer monitor, ``nan_guard`` skipping steps).
        cpu_malloc_mmap_threshold: on a CPU device with glibc, blocks of this many bytes or more are mapped on
            their own and returned to the OS when freed (:func:`smalti.core.cpu_malloc.configure_cpu_malloc`;
            default 1 MiB): otherwise glibc keeps the memory of freed activations and gradients. ``None``
            leaves the C library alone; glibc's ``MALLOC_MMAP_THRESHOLD_`` environment variable, when set, wins.
        cpu_gemm: the backend of the fp32 CPU matrix products of smalti's layers
            (:func:`smalti.core.cpu_gemm.configure_cpu_gemm`): ``auto`` (default) uses numpy's OpenBLAS on a CPU
            device when the CPU is not Intel's and torch's BLAS is MKL (MKL's slow path there), else torch;
            ``openblas`` insists (an error when it cannot apply); ``torch`` keeps torch's own BLAS.
    """

    def __init__(
        self,
        model: nn.Module,
        train_dataloader: Any,
        max_duration: Time | str,
        optimizers: OptimizerSpec = None,
        schedulers: Schedule | Iterable[Any] | None = None,
        eval_dataloader: Any = None,
        eval_interval: Time | str | None = "1ep",
        eval_subset_num_batches: int = -1,
        algorithms: PluginSpec = None,
        callbacks: PluginSpec = None,
        loggers: PluginSpec = None,
        device_train_microbatch_size: int | str | None = None,
        precision: str = "fp32",
        parallelism: Parallelism | None = None,
        device: str | torch.device | None = None,
        seed: int = 17,
        compile: bool = False,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        plugin_manager: SmaltiPluginManager | None = None,
        load_state: dict[str, Any] | None = None,
        log_interval: Time | str | int | None = None,
        deterministic: bool = False,
        progress_bar: bool = True,
        output_dir: str | os.PathLike[str] | None = None,
        optimizer_in_backward: bool = False,
        cpu_malloc_mmap_threshold: int | None = DEFAULT_MMAP_THRESHOLD,
        cpu_gemm: str = "auto",
    ) -> None:
        _check_model(model)
        check_precision(precision)
        if deterministic:
            configure_determinism()
        self.parallelism = parallelism or (DDP() if distributed.env_world_size() > 1 else SingleDevice())
        self.parallelism.init_distributed()
        if config is not None:
            distributed.check_same_config(config)
        seed_all(seed)  # every rank the same seed: identical initial weights without a broadcast
        self.seed = seed
        self.compile = compile
        self.pm = plugin_manager or new_plugin_manager()  # this trainer's own: no other run's plugins
        device = torch.device(device) if device is not None else distributed.default_device()
        configure_cpu_malloc(cpu_malloc_mmap_threshold, device)
        configure_cpu_gemm(cpu_gemm, device)

        micro, auto = self._parse_microbatch(device_train_microbatch_size)
        run_name = _given_run_name(run_name) if run_name else _default_run_name()
        self.output_dir = Path(output_dir) if output_dir is not None else Path("outputs") / run_name
        self.state = State(
            model=model,
            raw_model=model,
            max_duration=Time.from_input(max_duration),
            train_dataloader=train_dataloader,
            evaluators=self._evaluators(eval_dataloader, eval_subset_num_batches),
            run_name=run_name,
            output_dir=self.output_dir,
            device=device,
            precision=precision,
            rank=distributed.get_rank(),
            world_size=distributed.get_world_size(),
            device_train_microbatch_size=micro,
            auto_microbatching=auto,
            grad_scaler=make_grad_scaler(precision, device),
            plugin_manager=self.pm,
            config=config,
            eval_interval=Time.from_input(eval_interval) if eval_interval else None,
            optimizer_in_backward=bool(optimizer_in_backward),
        )
        self.state.dataloader_len = _safe_len(train_dataloader)
        if self.state.dataloader_len == 0:
            raise TrainingError(no_batch_message(train_dataloader, self.state.world_size))
        self.logger = Logger(self.pm.hook, self.state)
        #: Fires every hook of the loop (smalti.core.events.Events): one call form, whichever dispatcher runs it.
        self.events = Events(self.pm, self.state, self.logger)
        self._should_eval = self.events.hook("should_eval")  # who implements it: read every batch
        callbacks = _named(callbacks)
        if progress_bar and not any(isinstance(c, ProgressBar) for c in callbacks.values()):
            callbacks["progress_bar"] = ProgressBar()
        if loggers is None:
            loggers = self._default_loggers(default_dir=output_dir is None)
        self._run_plugins = self.pm.register_run_plugins(
            [("algorithms", _with_float8(_named(algorithms), precision)), ("callbacks", callbacks),
             ("loggers", _named(loggers))]
        )
        self._closed = False
        self._in_backward: list[OptimizerInBackward] = []
        self._replay = 0
        # A parallelism that keeps the base class's no-op gradient_sync needs no context around each microbatch.
        self._sync_context = type(self.parallelism).gradient_sync is not Parallelism.gradient_sync
        self._log_intervals = self._loss_intervals(log_interval)
        # Intervals in batches (the common case) are a modulo each step rather than a call to interval_fires.
        every = [int(t.value) for t in self._log_intervals if t.unit is TimeUnit.BATCH and t.value > 0]
        self._log_every = every if len(every) == len(self._log_intervals) else None
        self._token_counter: tuple[Any, Any] = (None, None)  # (model, its num_tokens method or None)
        self._pending_losses: list[tuple[int, torch.Tensor]] = []
        self._host_counts: tuple[Any, int, int] | None = None
        self._microbatch_settled = False
        try:
            self.events.fire(Event.INIT)
            model = self.state.raw_model
            on_meta = any(p.is_meta for p in model.parameters())
            if on_meta and not self.parallelism.shards_parameters:
                self._materialize(model, device)
                on_meta = False
            if not on_meta:
                model = model.to(device)
            self.state.raw_model = model
            self.state.model = self.parallelism.wrap(model, device, precision)
            if on_meta:
                self._materialize(model, device)
            self.state.device_mesh = self.parallelism.device_mesh
            self.state.dp_rank, self.state.dp_world_size = self.parallelism.dp_rank, self.parallelism.dp_world_size
            if compile:
                self.state.model.compile()
            self.state.optimizers = self._build_optimizers(optimizers)
            if optimizer_in_backward:
                check_optimizer_in_backward(self.state, self.pm)
                self._in_backward = OptimizerInBackward.attach(self.state.optimizers)
            self.state.schedulers = self._build_schedulers(schedulers)
            # Built now, as Composer does, not in the first evaluation: making them imports torchmetrics (seconds
            # in a fresh process), which would count as evaluation time and skew the runtime estimate.
            for evaluator in self.state.evaluators:
                self._ensure_metrics(evaluator)
            if config is not None:
                self.logger.log_hyperparameters(config)
            self.events.fire(Event.BEFORE_LOAD)
            if load_state is not None:
                self.state.load_state_dict(load_state)
            self.events.fire(Event.AFTER_LOAD)
        except BaseException as exc:
            self._fail(exc)
            raise

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _parse_microbatch(value: int | str | None) -> tuple[int | None, bool]:
        if value is None:
            return None, False
        if value == "auto":
            return None, True
        try:
            size = int(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"trainer.device_train_microbatch_size={value!r} must be a positive int, 'auto' or null"
            ) from None
        if size < 1:
            raise ConfigError(f"trainer.device_train_microbatch_size={value!r} must be at least 1")
        return size, False

    def _default_loggers(self, default_dir: bool) -> dict[str, Any]:
        """What ``smalti-train`` logs to (``logger: [console, jsonl]``): the console and ``metrics.jsonl``."""
        from smalti.core.loggers import ConsoleLogger, JSONLLogger

        if default_dir:
            from smalti.core.run_name import update_latest

            self.output_dir.mkdir(parents=True, exist_ok=True)
            update_latest(self.output_dir, self.output_dir.parent)
        return {"console": ConsoleLogger(), "jsonl": JSONLLogger(str(self.output_dir / "metrics.jsonl"))}

    def _loss_intervals(self, log_interval: Time | str | int | None) -> list[Time]:
        if log_interval is not None:
            return [Time.from_input(log_interval, "ba")]
        found = [getattr(p, "log_interval", None) for p in self.pm.get_plugins()]
        return [t for t in found if isinstance(t, Time)] or [Time.from_input("10ba")]

    @staticmethod
    def _evaluators(eval_dataloader: Any, subset: int) -> list[Evaluator]:
        if eval_dataloader is None:
            return []
        items = eval_dataloader if isinstance(eval_dataloader, list | tuple) else [eval_dataloader]
        out = []
        for i, item in enumerate(items):
            if isinstance(item, Evaluator):
                out.append(item)
            else:
                out.append(Evaluator(label="eval" if i == 0 else f"eval{i}", dataloader=item, subset_num_batches=subset))
        return out

    def _build_optimizers(self, optimizers: OptimizerSpec) -> list[torch.optim.Optimizer]:
        params = [p for p in self.state.model.parameters() if p.requires_grad]
        if optimizers is None:
            return [DecoupledAdamW(params, lr=1e-3)]
        items = optimizers if isinstance(optimizers, list | tuple) else [optimizers]
        built = []
        for item in items:
            if isinstance(item, torch.optim.Optimizer):
                if self.state.model is not self.state.raw_model or hasattr(self.parallelism, "mp_policy"):
                    own = {id(p) for group in item.param_groups for p in group["params"]}
                    if not own <= {id(p) for p in self.state.model.parameters()}:
                        raise ConfigError(
                            "the optimizer was built before the model was sharded; pass a factory instead "
                            "(functools.partial(torch.optim.AdamW, lr=...), or `_partial_: true` in the config)"
                        )
                built.append(item)
            elif callable(item):
                try:
                    built.append(item(params))
                except TypeError as exc:
                    target = getattr(item, "func", item)
                    raise ConfigError(
                        f"could not build the optimizer {getattr(target, '__qualname__', target)}: {exc}; "
                        "check the keys under `optimizer`"
                    ) from exc
            else:
                raise ConfigError(f"optimizer {item!r} is neither an optimizer nor a factory f(params)")
        return built

    def _build_schedulers(self, schedulers: Schedule | Iterable[Any] | None) -> list[Any]:
        if schedulers is None:
            return []
        items = [schedulers] if isinstance(schedulers, Schedule) or not isinstance(schedulers, Iterable) else list(schedulers)
        state = self.state
        built = []
        for item in items:
            if isinstance(item, Schedule):
                for opt in state.optimizers:
                    built.append(torch.optim.lr_scheduler.LambdaLR(opt, lambda step, s=item: s(state, step)))
            elif callable(item) and not hasattr(item, "step"):
                for opt in state.optimizers:
                    built.append(item(opt))
            else:
                built.append(item)
        return built

    @staticmethod
    def _materialize(model: nn.Module, device: torch.device) -> None:
        """Allocate a model built on the meta device and fill it with its ``init_weights()``."""
        init = getattr(model, "init_weights", None)
        if not callable(init):
            raise ConfigError(
                f"model {type(model).__name__} was built on the meta device but has no init_weights() to fill it in"
            )
        model.to_empty(device=device)
        with torch.no_grad():
            init()

    # ------------------------------------------------------------------ events

    # ------------------------------------------------------------------ the loop

    def fit(self) -> FitResult:
        """Train until ``max_duration`` or until a plugin's ``should_stop`` says so.

        Returns a :class:`FitResult`: ``metrics`` holds the last logged value of each metric
        (``result.metrics["loss/train/total"]``), ``state`` the run's :class:`State`, whose attributes the result
        also reads through (``result.timestamp``), as the State this method used to return.
        """
        state = self.state
        try:
            self.events.fire(Event.FIT_START)
            while not self._done():
                self._run_epoch()
                if state.stop_requested:
                    break
            self._flush_losses()
            state.checkpoint_requested = bool(self.events.decide("should_checkpoint", event=Event.FIT_END))
            if self.events.decide("should_eval", event=Event.FIT_END):
                self.eval()
            self.events.fire(Event.FIT_END)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.close()
        return FitResult(metrics=dict(self.logger.latest), state=state)

    def _done(self) -> bool:
        state = self.state
        if state.stop_requested:
            return True
        limit = state.max_duration
        if limit.unit is TimeUnit.BATCH:  # the common case, asked every step: a comparison, no call
            return state.timestamp.batch >= limit.value
        return state.reached(limit)

    def _run_epoch(self) -> None:
        state = self.state
        loader = state.train_dataloader
        self._prepare_epoch(loader)
        self.events.fire(Event.EPOCH_START)
        iterator = iter(loader)
        for _ in range(self._replay):
            next(iterator, None)
        self._replay = 0
        produced = False
        epoch_len = state.dataloader_len
        events = self.events
        while not self._done():
            if epoch_len is not None and state.timestamp.batch_in_epoch >= epoch_len:
                break
            events.fire(Event.BEFORE_DATALOADER)
            try:
                batch = next(iterator)
            except StopIteration:
                break
            produced = True
            # Counted on the host copy: counting tokens through an attention mask on the device would wait for it.
            samples, tokens = batch_size_of(batch), self._num_tokens(batch)
            state.batch = move_to_device(batch, state.device)
            self._host_counts = (state.batch, samples, tokens)
            events.fire(Event.AFTER_DATALOADER)
            self.train_step(state.batch)
            self._after_batch()
        else:
            return  # max duration or stop reached mid-epoch: the epoch is not over
        if not produced and state.timestamp.batch_in_epoch == 0:
            raise TrainingError(
                "the train dataloader yielded no batches this epoch; check the dataset, its split over ranks "
                "and drop_last with the batch size"
            )
        state.timestamp.advance_epoch()
        self.events.fire(Event.EPOCH_END)
        if self.events.decide("should_eval", event=Event.EPOCH_END):
            self.eval()
        state.checkpoint_requested = bool(self.events.decide("should_checkpoint", event=Event.EPOCH_END))
        self.events.fire(Event.EPOCH_CHECKPOINT)
        if self.events.decide("should_stop"):  # an epoch-end eval can be what decides it
            state.stop_requested = True

    def _prepare_epoch(self, loader: Any) -> None:
        """Tell the sampler the epoch, and skip what was already trained when resuming mid-epoch."""
        ts = self.state.timestamp
        seed_data_loading(loader, self.seed, ts.epoch)  # iter(loader) must not draw from the model's RNG stream
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(ts.epoch)
        dataset = getattr(loader, "dataset", None)
        if hasattr(dataset, "set_epoch"):  # streaming datasets order themselves per epoch
            dataset.set_epoch(ts.epoch)
        if ts.batch_in_epoch == 0:
            return
        if hasattr(sampler, "skip"):
            sampler.skip(ts.batch_in_epoch * (loader.batch_size or 1))
        elif self.state.dataloader_state_dict() is None:
            log.warning(
                "resuming at batch %d of epoch %d by replaying batches: the dataloader cannot skip ahead",
                ts.batch_in_epoch,
                ts.epoch,
            )
            self._replay = ts.batch_in_epoch

    def _after_batch(self) -> None:
        state = self.state
        events = self.events
        if state.batch_loss is not None:
            self._pending_losses.append((state.timestamp.batch, state.batch_loss))
            every = self._log_every
            if every is not None:
                batch = state.timestamp.batch
                fires = batch % every[0] == 0 if len(every) == 1 else any(batch % n == 0 for n in every)
            else:
                fires = any(interval_fires(i, state, "batch_end") for i in self._log_intervals)
            if fires:
                self._flush_losses()
        events.fire(Event.BATCH_END)
        if (state.evaluators or not _only_default_should_eval(self._should_eval.impls)) and events.decide(
            "should_eval", event=Event.BATCH_END
        ):
            self.eval()
        state.checkpoint_requested = bool(events.decide("should_checkpoint", event=Event.BATCH_END))
        if state.checkpoint_requested:
            self._flush_losses()  # a resumed run restarts after the checkpoint: the steps before it are logged
        events.fire(Event.BATCH_CHECKPOINT)
        if events.decide("should_stop"):
            state.stop_requested = True

    def _flush_losses(self) -> None:
        """Read the losses of the steps since the last read in one transfer and log each at its own step."""
        pending, self._pending_losses = self._pending_losses, []
        if not pending:
            return
        losses = [loss for _, loss in pending]
        try:  # the common case: every loss a 0-d fp32 tensor, stacked as they are
            stacked = torch.stack(losses)
        except RuntimeError:  # shapes differ (a model returned a 1-element loss)
            stacked = torch.stack([loss.reshape(()) for loss in losses])
        if stacked.dim() != 1:
            stacked = stacked.reshape(len(losses))
        if stacked.dtype != torch.float32:
            stacked = stacked.float()
        values = stacked.tolist()
        self.state.remember_batch_loss_value(pending[-1][1], values[-1])
        for (step, _), value in zip(pending, values):
            self.logger.log_metrics({"loss/train/total": value}, step=step)

    def train_step(self, batch: Any) -> torch.Tensor:
        """One optimizer step on ``batch``: microbatches, backward, optimizer and scheduler step, time advance."""
        state = self.state
        events = self.events
        start = time.perf_counter()
        events.fire(Event.BATCH_START)
        # Ranks of one sequence- or tensor-parallel group read the same samples: count them once. A model
        # under sequence parallelism counts only its own chunk's tokens, so tokens sum over every rank.
        counted, self._host_counts = self._host_counts, None
        if counted is not None and counted[0] is batch:
            samples, tokens = counted[1], counted[2]
        else:  # called directly, or a plugin replaced the batch after the data loader
            samples, tokens = batch_size_of(batch), num_tokens_of(state.raw_model, batch)
        state.batch_num_samples = samples * state.dp_world_size
        state.batch_num_tokens = tokens * state.world_size
        while True:
            for opt in state.optimizers:
                opt.zero_grad(set_to_none=True)
            events.fire(Event.BEFORE_TRAIN_BATCH)
            oom = False
            sparse = begin_sparse_grads(state.grad_scaler is None)
            try:
                loss = self.forward_backward(batch)
            except torch.OutOfMemoryError:
                if not state.auto_microbatching:
                    raise
                oom = True
            finally:
                end_sparse_grads()
            if state.auto_microbatching and self._some_rank_out_of_memory(oom):
                self._shrink_microbatch(batch)
                continue
            break
        if sparse:  # an embedding's row-sparse gradient (no scope under a gradient scaler): rows summed once
            settle_sparse_grads(sparse)
        # a second pass over the batch for SAM-like algorithms
        events.fire(Event.GRADIENTS_READY, recompute=lambda: self.forward_backward(batch))
        # Averaged in place over ranks: a copy, as ``loss`` may share memory with ``state.loss``.
        state.batch_loss = distributed.all_reduce_mean_(loss.clone()) if state.world_size > 1 else loss
        if state.grad_scaler is not None:
            for opt in state.optimizers:
                state.grad_scaler.unscale_(opt)
        events.fire(Event.AFTER_TRAIN_BATCH)
        state.skip_optimizer_step = False
        events.fire(Event.BEFORE_OPTIMIZER_STEP)
        if state.skip_optimizer_step and state.optimizer_in_backward:
            raise TrainingError(refuse_skipped_step())
        # With the step in backward every hooked gradient is gone: this steps only what is left (nothing).
        if not state.skip_optimizer_step:
            for opt in state.optimizers:
                if state.grad_scaler is not None:
                    state.grad_scaler.step(opt)
                else:
                    if sparse:  # parameters with a row-sparse gradient, before the rest
                        step_sparse_params(opt, sparse)
                    opt.step()
        if state.grad_scaler is not None:
            # Also after a skipped step: the scale must still back off, and unscale_ needs a fresh update.
            state.grad_scaler.update()
        for sched in state.schedulers:
            sched.step()
        events.fire(Event.AFTER_OPTIMIZER_STEP)
        state.timestamp.advance_batch(state.batch_num_samples, state.batch_num_tokens, time.perf_counter() - start)
        return state.batch_loss

    def _num_tokens(self, batch: Any) -> int:
        """:func:`num_tokens_of` the model, without looking its ``num_tokens`` up every step."""
        model = self.state.raw_model
        cached, counter = self._token_counter
        if cached is not model:
            counter = getattr(model, "num_tokens", None)
            self._token_counter = (model, counter if callable(counter) else None)
            counter = self._token_counter[1]
        if counter is not None:
            return int(counter(batch))
        kind = type(batch)
        return 0 if kind is tuple or kind is list else num_tokens_of(None, batch)

    def _some_rank_out_of_memory(self, oom: bool) -> bool:
        """Whether any rank ran out of memory in this try of the batch.

        The ranks agree (an all-reduce read on the host: a sync) only while the size is being searched: on the
        first step and on the step after each change. Once a size has worked on every rank it stays; a later
        out-of-memory error on one rank cannot be agreed on without a sync every step, so it is raised.
        """
        state = self.state
        if distributed.get_world_size() == 1:
            return oom
        if self._microbatch_settled:
            if oom:
                raise TrainingError(
                    f"out of memory at device_train_microbatch_size={state.device_train_microbatch_size} on rank "
                    f"{state.rank} after that size had worked on every rank; resume with a smaller "
                    "trainer.device_train_microbatch_size"
                )
            return False
        agreed = bool(distributed.all_reduce_max(int(oom), state.device))
        self._microbatch_settled = not agreed
        return agreed

    def _microbatch_size(self, batch: Any, n: int | None = None) -> int:
        state = self.state
        if n is None:
            n = batch_size_of(batch)
        if state.device_train_microbatch_size is None:
            state.device_train_microbatch_size = n
        return state.device_train_microbatch_size

    def _shrink_microbatch(self, batch: Any) -> None:
        state = self.state
        old = self._microbatch_size(batch)
        if old <= 1:
            raise TrainingError(
                "out of memory with device_train_microbatch_size=1; use a smaller model, sequence length, "
                "more sharding (parallelism=fsdp) or activation checkpointing"
            )
        new = max(1, old // 2)
        state.device_train_microbatch_size = new
        for opt in state.optimizers:
            opt.zero_grad(set_to_none=True)
        if state.device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("out of memory at microbatch size %d on some rank; retrying the batch at %d", old, new)
        self.events.fire("microbatch_size_change", old=old, new=new)
        self.logger.log_metrics({"trainer/device_train_microbatch_size": new})

    def forward_backward(self, batch: Any) -> torch.Tensor:
        """Forward and backward over the microbatches of ``batch``; returns the batch's mean loss (detached)."""
        state = self.state
        events = self.events
        total = batch_size_of(batch)
        micro_size = state.device_train_microbatch_size or self._microbatch_size(batch, total)
        microbatches = (batch,) if micro_size >= total else split_batch(batch, micro_size)
        count = state.num_microbatches = len(microbatches)
        if count > 1 and state.optimizer_in_backward:
            raise TrainingError(refuse_microbatches(micro_size, total))
        batch_loss: torch.Tensor | None = None
        for idx, micro in enumerate(microbatches):
            state.microbatch_idx = idx
            state.microbatch = micro
            events.fire(Event.MICROBATCH_START)
            # Only a parallelism with its own gradient_sync needs a context around each microbatch.
            if self._sync_context:
                with self.parallelism.gradient_sync(state.model, enabled=idx == count - 1):
                    part = self._microbatch_forward_backward(total, count)
            else:
                part = self._microbatch_forward_backward(total, count)
            batch_loss = part if batch_loss is None else batch_loss + part
            events.fire(Event.MICROBATCH_END)
        state.microbatch = None
        state.outputs = None
        assert batch_loss is not None  # split_batch gives at least one microbatch
        return batch_loss

    def _microbatch_forward_backward(self, total: int, count: int) -> torch.Tensor:
        """Forward, loss and backward of ``state.microbatch``, one of ``count`` microbatches of a ``total``-sample
        batch; returns its detached fp32 loss, weighted by its share of the batch."""
        state = self.state
        events = self.events
        events.fire(Event.BEFORE_FORWARD)
        if state.precision == "fp32":  # no autocast region to enter
            self._forward_and_loss()
        else:
            with autocast(state.precision, state.device):
                self._forward_and_loss()
        events.fire(Event.AFTER_LOSS)
        # One microbatch (the common case) needs no weighting: no extra op in the graph or after it.
        weight = 1.0 if count == 1 else batch_size_of(state.microbatch) / total
        scaled = state.loss if weight == 1.0 else state.loss * weight
        if state.grad_scaler is not None:
            scaled = state.grad_scaler.scale(scaled)
        events.fire(Event.BEFORE_BACKWARD)
        scaled.backward()
        events.fire(Event.AFTER_BACKWARD)
        part = state.loss.detach()
        if part.dtype != torch.float32:
            part = part.float()
        return part if weight == 1.0 else part * weight

    def _forward_and_loss(self) -> None:
        """``state.outputs`` and ``state.loss`` of ``state.microbatch``: the region autocast covers."""
        state = self.state
        events = self.events
        state.outputs = state.model(state.microbatch)
        events.fire(Event.AFTER_FORWARD)
        events.fire(Event.BEFORE_LOSS)
        state.loss = state.raw_model.loss(state.outputs, state.microbatch)

    # ------------------------------------------------------------------ evaluation

    def eval(self) -> dict[str, dict[str, float]]:
        """Run every evaluator, log ``metrics/<label>/<name>``, and return the computed values."""
        state = self.state
        if not state.evaluators:
            return {}
        # the pending step losses go first: W&B drops a step logged after a later one (eval logs at this step)
        self._flush_losses()
        self.events.fire(Event.EVAL_BEFORE_ALL)
        was_training = state.model.training
        state.model.eval()
        try:
            for evaluator in state.evaluators:
                state.eval_metrics[evaluator.label] = self._run_evaluator(evaluator)
        finally:
            state.model.train(was_training)
            state.eval_label = None
        state.last_eval_batch = state.timestamp.batch
        self.events.fire(Event.EVAL_AFTER_ALL)
        return state.eval_metrics

    def _ensure_metrics(self, evaluator: Evaluator) -> None:
        """Give ``evaluator`` the model's ``metrics(train=False)`` unless it has metrics of its own."""
        if not evaluator.metrics:
            maker = getattr(self.state.raw_model, "metrics", None)
            evaluator.metrics = dict(maker(train=False)) if callable(maker) else {}

    def _run_evaluator(self, evaluator: Evaluator) -> dict[str, float]:
        state = self.state
        state.eval_label = evaluator.label
        self._ensure_metrics(evaluator)
        metrics = evaluator.metrics
        for metric in metrics.values():
            metric.reset()
            metric.to(state.device)
        self.events.fire(Event.EVAL_START)
        seed_data_loading(evaluator.dataloader, self.seed, 0, stream=f"eval/{evaluator.label}")
        eval_forward = getattr(state.raw_model, "eval_forward", None)
        updater = getattr(state.raw_model, "update_metric", None)
        with torch.no_grad():
            for i, batch in enumerate(evaluator.dataloader):
                if 0 <= evaluator.subset_num_batches <= i:
                    break
                state.batch = move_to_device(batch, state.device)
                self.events.fire(Event.EVAL_BATCH_START)
                self.events.fire(Event.EVAL_BEFORE_FORWARD)
                with autocast(state.precision, state.device):
                    state.outputs = eval_forward(state.batch) if callable(eval_forward) else state.model(state.batch)
                self.events.fire(Event.EVAL_AFTER_FORWARD)
                for metric in metrics.values():
                    if callable(updater):
                        updater(state.batch, state.outputs, metric)
                    else:
                        metric.update(state.outputs, state.batch[1])
                self.events.fire(Event.EVAL_BATCH_END)
        values = {name: float(metric.compute()) for name, metric in metrics.items()}
        state.outputs = None
        self.events.fire(Event.EVAL_END)
        self.logger.log_metrics({f"metrics/{evaluator.label}/{name}": v for name, v in values.items()})
        return values

    # ------------------------------------------------------------------ teardown

    def _fail(self, exc: BaseException) -> None:
        try:
            try:
                self._flush_losses()  # the losses of the steps that did finish
            except Exception:  # noqa: BLE001 - the original error is the one to report
                log.debug("could not log the pending losses", exc_info=True)
            self.events.fire("exception", exc=exc)
        finally:
            self.close()

    def close(self) -> None:
        """Fire ``on_close`` once and unregister this run's plugins. Called by ``fit`` and on errors."""
        if self._closed:
            return
        self._closed = True
        for hooks in self._in_backward:
            hooks.remove()  # the model trains as usual again after this run
        try:
            self.events.fire(Event.CLOSE)
        finally:
            self.pm.unregister_run_plugins(self._run_plugins)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _only_default_should_eval(impls: list[Any]) -> bool:
    """Whether core's interval rule is the only ``should_eval``: it says no when there is nothing to evaluate."""
    return len(impls) == 1 and impls[0].function is default_should_eval


@dataclass(frozen=True)
class FitResult:
    """What :meth:`Trainer.fit` returns: the final metrics and the run's state.

    ``metrics`` maps each metric logged during the run (``loss/train/total``, ``metrics/eval/<name>``,
    ``throughput/...``) to its last value. Any other attribute is the state's (``result.timestamp``,
    ``result.batch_loss``), so code written when ``fit()`` returned the :class:`State` keeps working.
    """

    metrics: dict[str, float] = field(default_factory=dict)
    state: State | None = None

    @property
    def loss(self) -> float | None:
        """The last logged training loss (``metrics["loss/train/total"]``), ``None`` if none was logged."""
        return self.metrics.get("loss/train/total")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "state":  # copy/pickle probes, and a half-built instance
            raise AttributeError(name)
        return getattr(self.state, name)


def _safe_len(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _given_run_name(name: str) -> str:
    """``name`` when it is one safe folder name (it names ``outputs/<run_name>``), else a :class:`ConfigError`."""
    from smalti.core.run_name import check_run_name

    return check_run_name(str(name), "Trainer(run_name=...)")


def _default_run_name() -> str:
    """The launcher's name for the run, else a generated one that rank 0 decides and every rank receives."""
    from smalti.core import run_name

    name = run_name.stable_name_from_env()
    if name is not None:
        return name
    name = run_name.generate_run_name()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        shared = [name]
        torch.distributed.broadcast_object_list(shared, src=0)
        name = shared[0]
        run_name.mark_generated(name)
    return name
