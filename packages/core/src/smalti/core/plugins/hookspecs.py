"""The hook specifications: the reference for plugin authors.

Four kinds of hook, told apart by prefix:

* **discovery hooks** (``smalti_*``) are called once per process when the plugin manager is built;
* **event hooks** (``on_*``) are called by the trainer at fixed points of the loop, in the order of
  :class:`smalti.core.events.Event`; each receives ``state`` (:class:`~smalti.core.state.State`) and
  ``logger`` (:class:`~smalti.core.logger.Logger`) as keywords, and an implementation may take fewer;
* **decision hooks** (``should_*``) are ``firstresult``: the first implementation that returns something
  other than ``None`` decides; ``None`` means "no opinion";
* **state and logging hooks** gather resumable plugin state and fan metrics out to every logger.

Order inside one event: algorithms first (they change the state), then callbacks, loggers last. Within
a role, plugins run in the order the config lists them. Every rank calls every event hook unless a
hook's docstring says otherwise; loggers decide themselves whether to act on rank 0 only.

Loop order (one optimizer step with two microbatches, then an eval)::

    on_init, on_before_load, on_after_load,
    on_fit_start,
      on_epoch_start,
        on_before_dataloader, on_after_dataloader, on_batch_start, on_before_train_batch,
          (per microbatch) on_microbatch_start, on_before_forward, on_after_forward, on_before_loss,
          on_after_loss, on_before_backward, on_after_backward, on_microbatch_end,
        [on_gradients_ready (when implemented)], on_after_train_batch, on_before_optimizer_step, on_after_optimizer_step, on_batch_end,
        [on_eval_before_all, (per evaluator) on_eval_start, (per batch) on_eval_batch_start,
         on_eval_before_forward, on_eval_after_forward, on_eval_batch_end, on_eval_end, on_eval_after_all],
        on_batch_checkpoint,
      on_epoch_end, [eval block], on_epoch_checkpoint,
    on_fit_end, on_close
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from smalti.core.plugins.markers import hookspec

if TYPE_CHECKING:
    import pluggy
    import torch

    from smalti.core.events import Event
    from smalti.core.logger import Logger
    from smalti.core.state import State


# --------------------------------------------------------------------------------------------------
# Discovery hooks
# --------------------------------------------------------------------------------------------------


@hookspec
def smalti_config_searchpath() -> str | list[str] | None:
    """Return the Hydra config directory (or directories) a package ships, e.g. ``"pkg://smalti.moe.conf"``.

    Called once per process by core's Hydra ``SearchPathPlugin``. The options found there join the
    config groups of the same name (``model``, ``data``, ``callbacks``, ...), so installing a package is
    enough to make ``smalti-train model=<its option>`` work. Shipped paths are appended after core's own;
    the repository's ``conf/`` is prepended and wins over every shipped option of the same name.
    """


@hookspec(historic=True)
def smalti_addhooks(pluginmanager: pluggy.PluginManager) -> None:
    """Add hookspecs of a package's own with ``pluginmanager.add_hookspecs(module)``.

    Called for every plugin when it is registered (historic: late registrations are called too), as
    pytest's ``pytest_addhooks``. Implementations of such hooks in other packages should use
    ``@hookimpl(optionalhook=True)`` so they load when the package that specifies them is absent.
    """


@hookspec
def smalti_config_schemas() -> dict[str, type] | None:
    """Return the schemas of the config nodes a package owns, checked once Hydra has composed the run.

    Keys say which nodes a schema checks: a ``_target_`` (``"smalti.llm.LLM"``) checks every node built
    from that class wherever it sits (``model``, ``data.train``, ``callbacks.<name>``, ...); a name
    without a dot (``"trainer"``, ``"data"``) checks that top-level section. Values are pydantic models,
    best subclasses of :class:`smalti.core.config.types.Schema` (extra keys allowed, shared types such as
    ``TimeStr``, ``PositiveInt``, ``Probability``, ``ExistingPath``). A ``model_validator`` sees the whole
    resolved config in ``info.context["config"]`` for rules spanning sections and reports them with
    :func:`smalti.core.config.validate.field_error`.

    Called by ``smalti-train`` (and ``smalti plugins --run``) before any model, data or process group is
    built; every bad value of every schema is reported together as a
    :class:`~smalti.core.errors.ConfigError` (exit code 2), each line naming the full key, the value given
    and what is expected. Import the schemas inside the hook so the plugin module stays import-light.
    """


@hookspec(firstresult=True)
def smalti_plan_model(model: Any, setup: Any) -> Any:
    """Estimate one micro batch of ``model`` on one GPU for ``smalti plan``; ``None`` if not your model.

    ``model`` was built on the meta device from the run's ``model`` config; ``setup`` is a
    :class:`smalti.core.plan.types.PlanSetup` (the config, micro batch size, dtype sizes, sequence-parallel
    degree, GPU). Return a :class:`smalti.core.plan.types.ModelEstimate`: activation bytes by part at the
    step's peak (with the model's activation checkpointing and loss), training FLOPs of the micro batch
    (LLM Foundry's formula, for MFU), tokens, and notes to print. Called many times per plan (once per
    candidate micro batch size), so answer from arithmetic, not by running the model.
    """


# --------------------------------------------------------------------------------------------------
# Trainer set-up events
# --------------------------------------------------------------------------------------------------


@hookspec
def on_init(state: State, logger: Logger) -> None:
    """In ``Trainer.__init__``, once the model and dataloaders are in ``state`` and plugins are registered.

    Fires before the model is wrapped for parallelism and before the optimizers are built, so it may
    change the model (module surgery); ``state.optimizers`` is still empty here.
    """


@hookspec
def on_before_load(state: State, logger: Logger) -> None:
    """Before a checkpoint is loaded (fires even when there is none to load). May set where to load from."""


@hookspec
def on_after_load(state: State, logger: Logger) -> None:
    """After a checkpoint was loaded (or none was). ``state.timestamp`` now says where the run resumes."""


@hookspec
def on_fit_start(state: State, logger: Logger) -> None:
    """At the start of ``Trainer.fit()``, after the model is wrapped for parallelism and placed on device."""


@hookspec
def on_epoch_start(state: State, logger: Logger) -> None:
    """At the start of each epoch, after the sampler is told the epoch."""


# --------------------------------------------------------------------------------------------------
# Training batch events
# --------------------------------------------------------------------------------------------------


@hookspec
def on_before_dataloader(state: State, logger: Logger) -> None:
    """Before the next batch is drawn from the train dataloader."""


@hookspec
def on_after_dataloader(state: State, logger: Logger) -> None:
    """After the batch is drawn and moved to the device; may replace ``state.batch`` (batch transforms)."""


@hookspec
def on_batch_start(state: State, logger: Logger) -> None:
    """At the start of an optimizer step's batch, before gradients are zeroed."""


@hookspec
def on_before_train_batch(state: State, logger: Logger) -> None:
    """After gradients are zeroed, before the first microbatch. Fires again when an OOM retry restarts the batch."""


@hookspec
def on_microbatch_start(state: State, logger: Logger) -> None:
    """Before each microbatch; ``state.microbatch`` and ``state.microbatch_idx`` are set."""


@hookspec
def on_before_forward(state: State, logger: Logger) -> None:
    """Before the model's forward on the microbatch. May change ``state.microbatch``."""


@hookspec
def on_after_forward(state: State, logger: Logger) -> None:
    """After forward; ``state.outputs`` holds the model's outputs and may be changed."""


@hookspec
def on_before_loss(state: State, logger: Logger) -> None:
    """Before ``model.loss(outputs, batch)`` is computed."""


@hookspec
def on_after_loss(state: State, logger: Logger) -> None:
    """After the loss; ``state.loss`` may be changed (e.g. extra regularisation terms)."""


@hookspec
def on_before_backward(state: State, logger: Logger) -> None:
    """Before backward on the (scaled) microbatch loss."""


@hookspec
def on_after_backward(state: State, logger: Logger) -> None:
    """After backward; gradients of this microbatch have been accumulated."""


@hookspec
def on_microbatch_end(state: State, logger: Logger) -> None:
    """After each microbatch's backward."""


@hookspec
def on_gradients_ready(state: State, logger: Logger, recompute: Callable[[], torch.Tensor]) -> None:
    """After the batch's forward and backward over every microbatch, before ``on_after_train_batch``.

    The gradients of the whole batch are in ``.grad`` (reduced over data-parallel ranks, still scaled under
    ``amp_fp16``). ``recompute()`` runs the trainer's forward and backward over the same batch again (the
    microbatch events fire again, gradient accumulation and gradient sync as in the first pass), adding to
    ``.grad``, and returns the batch's mean loss; zero the gradients first to get the new ones alone.
    Algorithms that need a second pass at other weights use it (SAM: perturb, ``recompute()``, restore).
    The step's reported loss stays the first pass's. Listed in :class:`~smalti.core.events.Event` for its
    place in the loop, but fired only when some plugin implements it (it takes ``recompute`` besides
    ``state`` and ``logger``), on every rank alike; ``sam`` is the algorithm that uses it.
    """


@hookspec
def on_after_train_batch(state: State, logger: Logger) -> None:
    """After all microbatches, gradients unscaled (fp16), before the optimizer step. Gradient clipping goes here."""


@hookspec
def on_before_optimizer_step(state: State, logger: Logger) -> None:
    """Right before ``optimizer.step()``. Setting ``state.skip_optimizer_step = True`` skips this step."""


@hookspec
def on_after_optimizer_step(state: State, logger: Logger) -> None:
    """Right after ``optimizer.step()`` and the scheduler step (EMA updates and router-bias updates go here)."""


@hookspec
def on_batch_end(state: State, logger: Logger) -> None:
    """After the timestamp counted the batch; ``state.loss`` holds the batch's mean loss across ranks."""


# --------------------------------------------------------------------------------------------------
# Evaluation events
# --------------------------------------------------------------------------------------------------


@hookspec
def on_eval_before_all(state: State, logger: Logger) -> None:
    """Before an evaluation round over every evaluator (fires only when ``should_eval`` said yes)."""


@hookspec
def on_eval_start(state: State, logger: Logger) -> None:
    """Before one evaluator's dataloader is iterated; ``state.eval_label`` names it."""


@hookspec
def on_eval_batch_start(state: State, logger: Logger) -> None:
    """Before each eval batch; ``state.batch`` holds it."""


@hookspec
def on_eval_before_forward(state: State, logger: Logger) -> None:
    """Before the eval forward."""


@hookspec
def on_eval_after_forward(state: State, logger: Logger) -> None:
    """After the eval forward; ``state.outputs`` holds the outputs."""


@hookspec
def on_eval_batch_end(state: State, logger: Logger) -> None:
    """After the eval batch's metrics were updated."""


@hookspec
def on_eval_end(state: State, logger: Logger) -> None:
    """After one evaluator; ``state.eval_metrics[label]`` holds its computed metric values."""


@hookspec
def on_eval_after_all(state: State, logger: Logger) -> None:
    """After every evaluator ran; metrics have been logged."""


# --------------------------------------------------------------------------------------------------
# Checkpoint, epoch and run events
# --------------------------------------------------------------------------------------------------


@hookspec
def on_batch_checkpoint(state: State, logger: Logger) -> None:
    """After each batch (and its eval). ``state.checkpoint_requested`` says whether ``should_checkpoint`` asked for one."""


@hookspec
def on_epoch_end(state: State, logger: Logger) -> None:
    """After the last batch of an epoch; the timestamp has counted the epoch."""


@hookspec
def on_epoch_checkpoint(state: State, logger: Logger) -> None:
    """After the epoch's eval. ``state.checkpoint_requested`` says whether a checkpoint is due."""


@hookspec
def on_fit_end(state: State, logger: Logger) -> None:
    """When training stops (max duration reached or ``should_stop``); the final checkpoint goes here."""


@hookspec
def on_close(state: State, logger: Logger) -> None:
    """When the trainer closes (after ``fit`` or on error): flush and close files, threads and connections."""


@hookspec
def on_exception(state: State, logger: Logger, exc: BaseException) -> None:
    """When an exception escapes the loop, before ``on_close``; the exception is re-raised after."""


@hookspec
def on_microbatch_size_change(state: State, logger: Logger, old: int, new: int) -> None:
    """When automatic microbatching changed ``device_train_microbatch_size`` after an out-of-memory error.

    Every rank calls it with the same values; the batch is retried at the new size after it returns.
    """


# --------------------------------------------------------------------------------------------------
# Decision hooks (firstresult: the first non-None answer wins)
# --------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def should_stop(state: State) -> bool | None:
    """After each batch's eval and checkpoint: return ``True`` to end training now (``on_fit_end`` still fires)."""


@hookspec(firstresult=True)
def should_eval(state: State, event: Event) -> bool | None:
    """At ``BATCH_END`` and ``EPOCH_END`` (and once at ``FIT_END``): return whether to evaluate now.

    Core's interval plugin answers from ``trainer.eval_interval``, last; return non-None to override it.
    """


@hookspec(firstresult=True)
def should_checkpoint(state: State, event: Event) -> bool | None:
    """Before ``on_batch_checkpoint``/``on_epoch_checkpoint``/``on_fit_end``: return whether a checkpoint is due.

    The result is put in ``state.checkpoint_requested`` for the checkpoint events. A checkpoint plugin answers
    from its ``save_interval``; a preemption handler can return ``True`` to force one.
    """


# --------------------------------------------------------------------------------------------------
# State hooks
# --------------------------------------------------------------------------------------------------


@hookspec
def plugin_state_dict(state: State) -> dict[str, Any] | None:
    """Return this plugin's resumable state (tensors and plain Python values), or ``None`` if it has none.

    ``State.state_dict()`` calls each implementation and keys the result by the plugin's registration name.
    """


@hookspec
def load_plugin_state_dict(state: State, plugin_state: dict[str, Any]) -> None:
    """Restore what this plugin's ``plugin_state_dict`` returned. Called only for plugins with saved state."""


# --------------------------------------------------------------------------------------------------
# Logging hooks (every logger receives every call)
# --------------------------------------------------------------------------------------------------


@hookspec
def log_metrics(metrics: dict[str, float], step: int) -> None:
    """Record scalar metrics at ``step`` (the optimizer step). Must not block on network I/O."""


@hookspec
def log_hyperparameters(params: dict[str, Any]) -> None:
    """Record the run's resolved config and other hyperparameters, once at start."""


@hookspec
def log_artifact(local_path: str, name: str) -> None:
    """Record a file (a config, a report, a checkpoint manifest) under ``name``."""
