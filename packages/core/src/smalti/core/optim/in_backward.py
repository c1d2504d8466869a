"""The optimizer step fused into backward: each parameter is stepped as soon as its gradient is complete.

With ``Trainer(optimizer_in_backward=True)`` (``trainer.optimizer_in_backward=true``; torchtune's
``optimizer_in_bwd``, torchtitan's ``optimizer.early_step_in_backward``) no moment of the step holds every
gradient: a parameter's gradient is consumed by its optimizer step in a post-accumulate-grad hook and freed, so
the memory after backward is weights + optimizer state instead of weights + gradients + optimizer state.

The optimizer the run configured stays the one everything else sees (the *facade*): the LR scheduler drives
its ``param_groups``, loggers read them, and its ``state_dict``/``load_state_dict`` are the usual ones, so a
checkpoint written with the step in backward resumes without it and the other way round. Each parameter gets a
private optimizer of the same class whose state *is* the facade's (one shared ``state`` mapping, keyed by
parameter) and whose one param group copies the facade group's hyperparameters (``lr`` after the scheduler,
``betas``, ``weight_decay``, ...) right before its step. Hooks registered on the facade's step (an async
checkpoint's wait for its background copy) run before every per-parameter step too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from smalti.core.errors import ConfigError
from smalti.core.optim.row_sparse import step_sparse_params

#: Optimizers whose step needs every gradient at once (a closure re-evaluating the loss, one state for all).
_WHOLE_MODEL_OPTIMIZERS = (torch.optim.LBFGS,)


class OptimizerInBackward:
    """Steps ``optimizer`` one parameter at a time inside backward and frees each gradient after its step.

    ``optimizer`` is built as usual over all parameters (its param groups, hyperparameters and class are kept);
    this object registers a post-accumulate-grad hook on each of its parameters. With FSDP2 the hook fires on
    the sharded parameter after the gradient's reduce-scatter, so the step sees the reduced gradient shard.
    Call :meth:`remove` to take the hooks off again.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"trainer.optimizer_in_backward=true needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, _WHOLE_MODEL_OPTIMIZERS):
            raise ConfigError(
                f"trainer.optimizer_in_backward=true cannot step {type(optimizer).__name__} per parameter (its step "
                "needs the loss closure and every gradient at once); use AdamW/Adam/SGD or "
                "trainer.optimizer_in_backward=false"
            )
        self.optimizer = optimizer
        self._handles: list[Any] = []
        seen: set[int] = set()
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._hook(index, param)))

    def _per_parameter(self, index: int, param: torch.Tensor) -> torch.optim.Optimizer:
        """An optimizer of the facade's class over ``param`` alone that shares the facade's state and hooks.

        Built by copying the facade's attributes rather than calling the class's constructor: constructors differ
        (DecoupledAdamW moves ``weight_decay`` to its own key), the attributes are what the step reads.
        """
        facade = self.optimizer
        inner = type(facade).__new__(type(facade))
        inner.__dict__.update(facade.__dict__)  # defaults, state and the step-hook dicts: the same objects
        # an LR scheduler wraps the facade's step in an instance attribute bound to the facade: not this one's
        inner.__dict__.pop("step", None)
        inner.param_groups = [{**facade.param_groups[index], "params": [param]}]
        return inner

    def _hook(self, index: int, param: torch.Tensor) -> Any:
        inner = self._per_parameter(index, param)
        facade = self.optimizer

        @torch.no_grad()
        def step(p: torch.Tensor) -> None:
            own = inner.param_groups[0]
            # load_state_dict replaces the facade's groups and state: read them again at every step
            for key, value in facade.param_groups[index].items():
                if key != "params":
                    own[key] = value
            inner.state = facade.state
            if p.grad.layout == torch.sparse_coo:  # an embedding's: stepped by blocks, or made dense
                step_sparse_params(inner)
            if p.grad is not None:
                inner.step()
            p.grad = None

        return step

    def remove(self) -> None:
        """Take the hooks off the parameters: later backward passes keep their gradients again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @staticmethod
    def attach(optimizers: Iterable[torch.optim.Optimizer]) -> list[OptimizerInBackward]:
        """One :class:`OptimizerInBackward` per optimizer (each over its own parameters)."""
        return [OptimizerInBackward(opt) for opt in optimizers]
