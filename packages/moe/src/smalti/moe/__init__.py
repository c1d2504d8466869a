"""smalti-moe: a dropless Mixture-of-Experts layer with PyTorch and Triton backends and expert parallelism."""

__version__ = "0.1.0"

from smalti.moe.errors import MoEError  # noqa: E402
from smalti.moe.layer import MoE  # noqa: E402
from smalti.moe.losses import load_balancing_loss, router_z_loss  # noqa: E402
from smalti.moe.router import Router  # noqa: E402

__all__ = ["MoE", "MoEError", "Router", "load_balancing_loss", "router_z_loss"]
