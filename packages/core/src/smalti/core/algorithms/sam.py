"""Sharpness-aware minimisation (SAM, Foret et al. 2021): step with the gradient taken at the worst nearby weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from smalti.core import distributed
from smalti.core._compat import foreach_add_, foreach_copy_, foreach_mul
from smalti.core.config.types import NonNegativeFloat, PositiveFloat, TimeOrBatches
from smalti.core.errors import ConfigError
from smalti.core.intervals import batch_count
from smalti.core.optim.row_sparse import densify_grads
from smalti.core.plugins import Algorithm
from smalti.core.tensors import local_shard


class SAM(Algorithm):
    """Every ``interval`` optimizer steps, a SAM step instead of a plain one (Composer's SAM; ``interval=1``: all).

    A SAM step takes the batch's gradient ``g`` at the weights ``w``, moves to ``w + rho * g / (||g|| + epsilon)``
    (``||g||`` the global L2 norm over every parameter, and over every shard under FSDP2), runs forward and
    backward over the same batch again there (the trainer's ``recompute``, through the ``on_gradients_ready``
    hook: microbatches, gradient accumulation and gradient sync as in the first pass), puts ``w`` back exactly
    and lets the optimizer step with the second gradient. So a SAM step costs a second forward and backward.
    The step's loss (``loss/train/total``) is the one at ``w``; algorithms at ``on_after_train_batch`` (gradient
    clipping, layer freezing) see the second gradient. Other steps are plain. The SAM steps are the
    ``interval``-th, ``2 * interval``-th, ... (by the step count alone, so a resumed run takes the same ones).

    Logs per SAM step ``sam/grad_norm`` (``||g||``) and ``sam/perturbed_loss`` (the loss at the perturbed weights,
    averaged over ranks), kept on the device and read every ``log_every`` batches, before a checkpoint and at fit
    end. ``amp_fp16`` is refused (its scaled, possibly infinite first gradients would make the perturbation NaN).
    """

    def __init__(
        self,
        rho: PositiveFloat = 0.05,
        epsilon: NonNegativeFloat = 1.0e-12,
        interval: TimeOrBatches = 1,
        log_every: TimeOrBatches = "10ba",
    ) -> None:
        if not rho > 0:
            raise ConfigError(f"algorithms.sam.rho={rho} must be > 0")
        if not epsilon >= 0:
            raise ConfigError(f"algorithms.sam.epsilon={epsilon} must be >= 0")
        self.rho = float(rho)
        self.epsilon = float(epsilon)
        self.interval = batch_count(interval, "algorithms.sam.interval", "1ba")
        self.log_every = batch_count(log_every, "algorithms.sam.log_every")
        self._every = self.interval  # read by bench/callback_cost.py: the steps where it does its work
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def on_fit_start(self, state: Any) -> None:
        if state.grad_scaler is not None:
            raise ConfigError(
                f"algorithms.sam does not support trainer.precision={state.precision!r} (its gradients are scaled "
                "and may hold inf before the scaler skips the step); use amp_bf16 or fp32"
            )

    def is_sam_step(self, step: int) -> bool:
        """Whether the optimizer step with 0-based index ``step`` is a SAM step."""
        return (step + 1) % self.interval == 0

    @torch.no_grad()
    def on_gradients_ready(self, state: Any, recompute: Callable[[], torch.Tensor]) -> None:
        if not self.is_sam_step(state.timestamp.batch):
            return
        params = [p for p in state.model.parameters() if p.grad is not None]
        if not params:
            return
        densify_grads(params)  # the perturbation moves every weight by its gradient
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # DTensor: the norm over every shard
            norm = norm.full_tensor()
        weights = [local_shard(p) for p in params]
        kept = [w.clone() for w in weights]
        perturbation = foreach_mul([local_shard(p.grad) for p in params], self.rho / (norm + self.epsilon))
        foreach_add_(weights, perturbation)
        del perturbation
        for p in state.model.parameters():
            p.grad = None
        with torch.enable_grad():
            perturbed_loss = recompute()
        foreach_copy_(weights, kept)
        self._pending.append(
            (
                state.timestamp.batch + 1,
                norm.detach().reshape(()).float(),
                perturbed_loss.detach().reshape(()).float(),
            )
        )

    def on_batch_end(self, state: Any, logger: Any) -> None:
        if self._pending and state.timestamp.batch % self.log_every == 0:
            self._flush(state, logger)

    def on_batch_checkpoint(self, state: Any, logger: Any) -> None:
        if state.checkpoint_requested:  # a run resumed from this checkpoint starts after it: log what it had
            self._flush(state, logger)

    def on_fit_end(self, state: Any, logger: Any) -> None:
        self._flush(state, logger)

    def _flush(self, state: Any, logger: Any) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        losses = torch.stack([loss for _, _, loss in pending])
        if state.world_size > 1:
            distributed.all_reduce_mean_(losses)
        values = torch.cat([torch.stack([norm for _, norm, _ in pending]), losses]).tolist()  # one read
        n = len(pending)
        for i, (step, _, _) in enumerate(pending):
            logger.log_metrics({"sam/grad_norm": values[i], "sam/perturbed_loss": values[n + i]}, step=step)
