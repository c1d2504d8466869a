"""What ``smalti plan`` hands a model's plugin, and what the plugin answers (hook ``smalti_plan_model``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PlanSetup:
    """The run as one GPU sees it, for :func:`smalti.core.plugins.hookspecs.smalti_plan_model`.

    Byte sizes are those of one element: ``compute_bytes`` of matrix products (2 under bf16/fp16 autocast or
    FSDP half-precision parameters), ``residual_bytes`` of activations produced by the parameters as forward
    sees them (the embedding output), ``autocast_bytes`` of the autocast dtype (``None`` without autocast),
    ``weight_bytes`` of parameters in forward (FSDP's ``param_dtype``, else the master dtype).
    """

    cfg: Any
    micro_batch_size: int
    compute_bytes: int
    residual_bytes: int
    autocast_bytes: int | None
    weight_bytes: int
    #: Ranks splitting each sequence (sequence parallelism); 1 without it.
    sp: int = 1
    #: Ranks splitting the model's experts (expert parallelism); 1 without it.
    ep: int = 1
    #: The accelerator name (h100, a100, h200, l4, cpu) and the number of GPUs in the run.
    gpu: str = "h100"
    world_size: int = 1
    #: Whether batches carry ``sequence_id`` (documents masked from each other), as ``plan.sequence_id`` says.
    sequence_id: bool = False
    #: The ``experiment=<name>`` override, if any (to compare with published figures for it).
    experiment: str | None = None


@dataclass
class ModelEstimate:
    """A model's own account of one micro batch on one GPU.

    ``activations``: named parts in bytes, summed into the plan's activation memory at the step's peak.
    ``flops``: training FLOPs of the micro batch by LLM Foundry's formula (what MFU divides), for the whole
    sequence (each of ``sp`` ranks does ``1/sp`` of it). ``hardware_flops``: FLOPs actually executed,
    recomputation included (default ``flops``). ``tokens``: tokens in the micro batch. ``notes``: lines
    printed with the plan (assumptions, published figures to compare with). ``frozen_bytes``: bytes the frozen
    parameters are held in when that differs from their dtype on the meta device (e.g. a base quantised to 4
    bits after loading); ``None``: their meta dtype's size.
    """

    activations: dict[str, float]
    flops: float | None = None
    hardware_flops: float | None = None
    tokens: int = 0
    notes: list[str] = field(default_factory=list)
    frozen_bytes: float | None = None
    #: Bytes one GPU sends by all-to-all per micro batch (expert parallelism's routed tokens, both ways,
    #: forward and backward); timed at the bandwidth of an ``ep`` group.
    all_to_all_bytes: float = 0.0
