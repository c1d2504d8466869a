"""Splitting a batch into microbatches and counting its samples and tokens, for any nesting of tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from smalti.core.errors import TrainingError


def batch_size_of(batch: Any) -> int:
    """Number of samples in ``batch``: the leading dimension of its first tensor."""
    kind = type(batch)
    if (kind is tuple or kind is list) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].shape[0])  # the common case, without the slower abstract-class checks below
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        for value in batch.values():
            try:
                return batch_size_of(value)
            except TrainingError:
                continue
    elif isinstance(batch, Sequence) and not isinstance(batch, str):
        for value in batch:
            try:
                return batch_size_of(value)
            except TrainingError:
                continue
    raise TrainingError(
        f"cannot tell the batch size of a {type(batch).__name__}: a batch must hold at least one tensor "
        "(a tensor, a tuple/list or a dict of tensors)"
    )


def split_batch(batch: Any, microbatch_size: int) -> list[Any]:
    """Split ``batch`` along its first dimension into chunks of ``microbatch_size`` samples."""
    n = batch_size_of(batch)
    if microbatch_size >= n:
        return [batch]
    starts = range(0, n, microbatch_size)
    return [_slice(batch, s, min(s + microbatch_size, n), n) for s in starts]


def _slice(batch: Any, start: int, end: int, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:end] if batch.dim() > 0 and batch.shape[0] == n else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, start, end, n) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple):
        return tuple(_slice(v, start, end, n) for v in batch)
    if isinstance(batch, list):
        if len(batch) == n and not any(isinstance(v, torch.Tensor) for v in batch):
            return batch[start:end]
        return [_slice(v, start, end, n) for v in batch]
    return batch


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor inside ``batch`` to ``device`` (non-blocking)."""
    kind = type(batch)
    # The common case first: the Mapping check below is an abstract-class one, a few times slower.
    if kind is tuple or kind is list:
        # A plain tensor already on the device (every tensor, on CPU) is kept without a call per element.
        moved = [v if v.__class__ is torch.Tensor and v.device == device else move_to_device(v, device) for v in batch]
        return tuple(moved) if kind is tuple else moved
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: move_to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple):
        return tuple(move_to_device(v, device) for v in batch)
    if isinstance(batch, list):
        return [move_to_device(v, device) for v in batch]
    return batch


def num_tokens_of(model: Any, batch: Any) -> int:
    """Tokens in ``batch``: the model's ``num_tokens(batch)`` if it has one, else ``input_ids``' element count."""
    counter = getattr(model, "num_tokens", None)
    if callable(counter):
        return int(counter(batch))
    kind = type(batch)
    if kind is tuple or kind is list:  # no input_ids to count, without the abstract-class Mapping check
        return 0
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return int(batch["input_ids"].numel())
    return 0
