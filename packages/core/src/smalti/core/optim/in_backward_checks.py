"""What cannot run with the optimizer step in backward, refused before the first step with the key at fault.

Stepping a parameter as soon as its gradient is complete rules out everything that needs all gradients at
once, or a gradient that is still to grow: accumulation over microbatches, a grad scaler's global inf check,
DDP (the hook fires before DDP's bucketed all-reduce has averaged the gradient), and plugins that read or
change gradients between backward and the step. A plugin declares the last by a truthy
``optimizer_in_backward_conflict`` attribute: the reason, which the error repeats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.nn.parallel import DistributedDataParallel

from smalti.core.errors import ConfigError

if TYPE_CHECKING:
    from smalti.core.plugins.manager import SmaltiPluginManager
    from smalti.core.state import State

_KEY = "trainer.optimizer_in_backward=true"


def check_optimizer_in_backward(state: State, pm: SmaltiPluginManager) -> None:
    """Raise :class:`ConfigError` naming the first setting of this run that needs every gradient at once."""
    if state.auto_microbatching:
        raise ConfigError(
            f"{_KEY} cannot be combined with trainer.device_train_microbatch_size=auto: a smaller microbatch "
            "accumulates gradients over several backward passes, and the step in backward would run after the "
            "first; set trainer.device_train_microbatch_size=null (one backward per batch) or "
            "trainer.optimizer_in_backward=false"
        )
    if state.grad_scaler is not None:
        raise ConfigError(
            f"{_KEY} cannot be combined with trainer.precision={state.precision}: its grad scaler checks every "
            "gradient for inf/NaN before any step; use trainer.precision=amp_bf16 or fp32"
        )
    if isinstance(state.model, DistributedDataParallel):
        raise ConfigError(
            f"{_KEY} cannot be combined with parallelism=ddp: the step would run on this rank's gradient before "
            "DDP's all-reduce averages it; use parallelism=fsdp (FSDP2 runs the step after each gradient's "
            "reduce-scatter) or trainer.optimizer_in_backward=false"
        )
    for plugin in pm.get_plugins():
        reason = getattr(plugin, "optimizer_in_backward_conflict", None)
        if reason and isinstance(reason, str):
            name = pm.get_name(plugin)
            raise ConfigError(
                f"{_KEY} cannot be combined with the plugin {name!r} ({type(plugin).__name__}): {reason}; remove "
                f"it from the run or set trainer.optimizer_in_backward=false"
            )
    for impl in pm.hook.on_gradients_ready.get_hookimpls():
        raise ConfigError(
            f"{_KEY} cannot be combined with the plugin {impl.plugin_name!r}: it implements on_gradients_ready "
            "(a second pass over the batch, as SAM does), but every gradient is consumed by its step during "
            "backward; remove it or set trainer.optimizer_in_backward=false"
        )


def refuse_microbatches(micro_size: int, total: int) -> str:
    """The error for a batch of ``total`` samples split into microbatches of ``micro_size``."""
    return (
        f"{_KEY} cannot accumulate gradients: trainer.device_train_microbatch_size={micro_size} splits this "
        f"batch of {total} samples into several backward passes and each parameter would be stepped after the "
        "first; set trainer.device_train_microbatch_size=null or at least the per-rank batch size"
    )


def refuse_skipped_step() -> str:
    """The error when a plugin asks to skip a step that already ran inside backward."""
    return (
        f"a plugin set state.skip_optimizer_step, but with {_KEY} every parameter was already stepped during "
        "backward; remove the plugin that skips steps (callbacks.nan_guard.action=skip) or set "
        "trainer.optimizer_in_backward=false"
    )

