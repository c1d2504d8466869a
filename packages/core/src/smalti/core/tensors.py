"""Small tensor helpers shared by the algorithms and monitors that read or change the weights in place."""

from __future__ import annotations

import torch


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself; in-place ops on it change the original."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def weights_and_float_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and floating-point buffers (batch-norm statistics) by name: what an average of
    the weights (EMA, SWA) keeps; integer buffers such as batch counters are left out."""
    named = dict(model.named_parameters())
    named.update({k: b for k, b in model.named_buffers() if b.is_floating_point()})
    return named
