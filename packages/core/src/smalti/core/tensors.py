"""Small tensor helpers shared by the algorithms and monitors that read or change the weights in place."""

from __future__ import annotations

from typing import Any

import torch

from smalti.core.errors import TrainingError


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself; in-place ops on it change the original."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def weights_and_float_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and floating-point buffers (batch-norm statistics) by name: what an average of
    the weights (EMA, SWA) keeps; integer buffers such as batch counters are left out."""
    named = dict(model.named_parameters())
    named.update({k: b for k, b in model.named_buffers() if b.is_floating_point()})
    return named


@torch.no_grad()
def copy_saved_tensors(into: dict[str, torch.Tensor], saved: dict[str, Any], what: str, option: str) -> None:
    """Copy a checkpoint's tensors into ``into`` in place, by name; a ``TrainingError`` naming the names that
    differ when the two do not hold the same ones (``what`` the state, ``option`` the config key to drop)."""
    missing, unexpected = set(into) - set(saved), set(saved) - set(into)
    if missing or unexpected:
        raise TrainingError(
            f"{what} in the checkpoint does not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}; load it into the same model, or drop {option}'s state"
        )
    for name, tensor in into.items():
        tensor.copy_(saved[name])
