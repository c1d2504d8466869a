"""smalti-moe: a dropless Mixture-of-Experts layer with PyTorch and Triton backends and expert parallelism.

Names are imported lazily so that ``smalti.moe.plugin`` (loaded by every smalti process) pulls in no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "MoE": "smalti.moe.layer",
    "MoEError": "smalti.moe.errors",
    "Router": "smalti.moe.router",
    "Routing": "smalti.moe.router",
    "load_balancing_loss": "smalti.moe.losses",
    "router_z_loss": "smalti.moe.losses",
    "update_expert_biases": "smalti.moe.balancing",
    "AuxFreeBiasUpdate": "smalti.moe.balancing",
}

__all__ = ["AuxFreeBiasUpdate", "MoE", "MoEError", "Router", "Routing", "load_balancing_loss", "router_z_loss",
           "update_expert_biases"]

if TYPE_CHECKING:
    from smalti.moe.balancing import AuxFreeBiasUpdate, update_expert_biases
    from smalti.moe.errors import MoEError
    from smalti.moe.layer import MoE
    from smalti.moe.losses import load_balancing_loss, router_z_loss
    from smalti.moe.router import Router, Routing


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'smalti.moe' has no attribute {name!r}")
