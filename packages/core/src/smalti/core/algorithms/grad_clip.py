"""Gradient clipping by global norm or by value, after gradients are complete and unscaled."""

from __future__ import annotations

from typing import Any, Literal

import torch

from smalti.core.config.types import PositiveFloat, TimeOrBatches
from smalti.core.errors import ConfigError
from smalti.core.intervals import batch_count
from smalti.core.optim import row_sparse
from smalti.core.plugins import Algorithm


class GradientClipping(Algorithm):
    """Clips gradients in ``on_after_train_batch``, before the optimizer step.

    ``clipping_type="norm"`` scales all gradients together so that their global L2 norm is at most
    ``clipping_threshold`` (``torch.nn.utils.clip_grad_norm_``; with FSDP2's DTensor gradients the norm is
    the one over every shard) and logs the norm before clipping as ``grad_norm``. ``"value"`` clamps each
    gradient element to ``[-clipping_threshold, clipping_threshold]``.

    The norms stay on the device and are read in one transfer every ``log_every`` batches (a ``ba`` interval,
    default ``"10ba"``, the trainer's default loss interval), before a checkpoint and at fit end; each is logged
    at the step it belongs to. Clipping itself never waits for the device.
    """

    #: Why ``trainer.optimizer_in_backward=true`` refuses this algorithm (no gradient is left after backward).
    optimizer_in_backward_conflict = (
        "it clips the gradients after backward, when the step in backward has already used and freed them "
        "(clipping by global norm needs every gradient at once)"
    )

    def __init__(
        self, clipping_type: Literal["norm", "value"] = "norm", clipping_threshold: PositiveFloat = 1.0, log_every: TimeOrBatches = "10ba"
    ) -> None:
        if clipping_type not in ("norm", "value"):
            raise ConfigError(
                f"algorithms.gradient_clipping.clipping_type={clipping_type!r} must be 'norm' or 'value'"
            )
        if not clipping_threshold > 0:
            raise ConfigError(
                f"algorithms.gradient_clipping.clipping_threshold={clipping_threshold} must be > 0"
            )
        self.clipping_type = clipping_type
        self.clipping_threshold = float(clipping_threshold)
        self.log_every = batch_count(log_every, "algorithms.gradient_clipping.log_every")
        self._pending: list[tuple[int, torch.Tensor]] = []

    def on_after_train_batch(self, state: Any) -> None:
        params = [p for p in state.model.parameters() if p.grad is not None]
        if not params:
            return
        sparse = bool(row_sparse.sparse_grad_params(params))  # an embedding's row-sparse gradient
        if self.clipping_type == "value":
            clip_value = row_sparse.clip_grad_value if sparse else torch.nn.utils.clip_grad_value_
            clip_value(params, self.clipping_threshold)
        else:
            clip_norm = row_sparse.clip_grad_norm if sparse else torch.nn.utils.clip_grad_norm_
            norm = clip_norm(params, self.clipping_threshold)
            if hasattr(norm, "full_tensor"):  # DTensor: reduce over the shards now, while every rank is here
                norm = norm.full_tensor()
            self._pending.append((state.timestamp.batch + 1, norm.detach().reshape(())))

    def on_batch_end(self, state: Any, logger: Any) -> None:
        if self._pending and state.timestamp.batch % self.log_every == 0:
            self._flush(logger)

    def on_batch_checkpoint(self, state: Any, logger: Any) -> None:
        if state.checkpoint_requested:  # a run resumed from this checkpoint starts after it: log what it had
            self._flush(logger)

    def on_fit_end(self, logger: Any) -> None:
        self._flush(logger)

    def _flush(self, logger: Any) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        values = torch.stack([norm.float() for _, norm in pending]).tolist()  # the one read of the interval
        for (step, _), value in zip(pending, values):
            logger.log_metrics({"grad_norm": value}, step=step)
