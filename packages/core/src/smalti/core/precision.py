"""Numeric precision of the training step: ``fp32``, ``amp_bf16``, ``amp_fp16`` (with a gradient scaler) and
``amp_fp8`` (bf16 autocast, with the linear layers in float8: :class:`smalti.core.algorithms.Float8Training`)."""

from __future__ import annotations

import contextlib

import torch

from smalti.core.errors import ConfigError

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "amp_fp8")


def check_precision(precision: str) -> str:
    """Return ``precision`` if smalti knows it, else raise naming the valid ones."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return precision


_FP32 = contextlib.nullcontext()


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The autocast region for the forward and loss at ``precision`` on ``device`` (nothing to enter for fp32)."""
    if precision == "fp32":
        return _FP32
    dtype = torch.float16 if precision == "amp_fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for ``amp_fp16``; ``None`` for the others (bf16 and fp32 need none)."""
    if precision != "amp_fp16":
        return None
    return torch.amp.GradScaler(device.type)
