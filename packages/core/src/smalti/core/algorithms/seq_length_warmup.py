"""Sequence-length warmup: training starts on short sequences and their length grows linearly to the full one."""

from __future__ import annotations

from typing import Any

import torch

from smalti.core.config.types import PositiveInt, TimeOrFraction
from smalti.core.errors import ConfigError, TimeError, TrainingError
from smalti.core.plugins import Algorithm
from smalti.core.time import Time


class SeqLengthWarmup(Algorithm):
    """Cuts each batch's sequences to a length that grows linearly from ``min_seq_length`` to
    ``max_seq_length`` over ``duration`` (Composer's SeqLengthWarmup), in multiples of ``step_size``.

    The batch must be a dict whose sequence tensors are ``[batch, time]`` (``input_ids`` and any other
    tensor of the same shape, e.g. ``attention_mask`` or ``labels``). ``truncate=True`` keeps the first
    ``L`` positions of every sequence; ``truncate=False`` cuts each sequence into ``T // L`` segments of
    ``L`` (more, shorter rows; the remainder is dropped). The batch is replaced in ``on_after_dataloader``,
    before the trainer counts it, so ``timestamp.token`` (hence a token-based schedule and the speed
    monitor's tokens per second) counts the tokens actually trained. Logs ``seq_length_warmup/seq_length``
    when it changes. The length is a function of the step, so a resumed run cuts the same way.
    """

    def __init__(self, duration: TimeOrFraction = "0.3dur", min_seq_length: PositiveInt = 8, max_seq_length: PositiveInt = 1024,
                 step_size: PositiveInt = 8, truncate: bool = True) -> None:
        if not 0 < min_seq_length <= max_seq_length:
            raise ConfigError(
                f"algorithms.seq_length_warmup.min_seq_length={min_seq_length} must be > 0 and <= max_seq_length="
                f"{max_seq_length}"
            )
        if step_size < 1:
            raise ConfigError(f"algorithms.seq_length_warmup.step_size={step_size} must be >= 1")
        try:
            self.duration = Time.from_input(duration, "dur")
        except TimeError as exc:
            raise ConfigError(f"algorithms.seq_length_warmup.duration={duration!r}: {exc}") from None
        self.min_seq_length, self.max_seq_length = int(min_seq_length), int(max_seq_length)
        self.step_size, self.truncate = int(step_size), truncate
        self._logged = -1

    def seq_length(self, state: Any, step: int) -> int:
        """The length for the ``step``-th batch (0-based): linear in the step, a multiple of ``step_size``."""
        span = max(1, state.to_batches(self.duration))
        fraction = min(1.0, step / span)
        length = self.min_seq_length + fraction * (self.max_seq_length - self.min_seq_length)
        length = int(length) // self.step_size * self.step_size
        return max(self.min_seq_length, min(self.max_seq_length, length))

    def on_after_dataloader(self, state: Any, logger: Any) -> None:
        batch = state.batch
        if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), torch.Tensor):
            raise TrainingError(
                "algorithms.seq_length_warmup needs dict batches with an input_ids tensor [batch, time]; got "
                f"{type(batch).__name__}; drop algorithms.seq_length_warmup for this data"
            )
        shape = batch["input_ids"].shape
        length = self.seq_length(state, state.timestamp.batch)
        if length < shape[1]:
            state.batch = {k: self._cut(v, length) if isinstance(v, torch.Tensor) and v.shape[:2] == shape[:2]
                           else v for k, v in batch.items()}
        if length != self._logged:
            self._logged = length
            logger.log_metrics({"seq_length_warmup/seq_length": float(min(length, shape[1]))},
                               step=state.timestamp.batch + 1)

    def _cut(self, tensor: torch.Tensor, length: int) -> torch.Tensor:
        if self.truncate:
            return tensor[:, :length].contiguous()
        rows, time = tensor.shape[:2]
        whole = time // length * length
        return tensor[:, :whole].reshape(rows * (time // length), length, *tensor.shape[2:])
