"""The arithmetic of a plan: per-GPU memory of parameters, gradients and optimizer state under a parallelism,
and a roofline step time. Pure functions of counts and byte sizes, so each formula is testable alone."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from smalti.core.plan.hardware import Accelerator


@dataclass(frozen=True)
class Layout:
    """How the run spreads over GPUs.

    ``kind``: single, ddp, fsdp or hsdp. ``shard``: ranks a parameter is split over (1 for single/ddp).
    ``replicate``: copies of each shard (ddp: the world; hsdp: the replicate dimension). ``sp``: ranks per
    sequence. ``reshard_after_forward``: FSDP frees gathered block weights after forward (and gathers again
    in backward). ``ep``: ranks the model's expert parameters are split over (expert parallelism, borrowed
    from the ``shard`` ranks as torchtitan does: FSDP shards the experts over the other ``shard / ep``).
    """

    kind: str
    world: int
    gpus_per_node: int
    shard: int = 1
    replicate: int = 1
    sp: int = 1
    reshard_after_forward: bool = True
    #: FSDP reduce-scatters every micro batch's gradients (sharded accumulation) rather than only the last's.
    reduce_every_microbatch: bool = True
    ep: int = 1

    @property
    def dp(self) -> int:
        """Different shares of each global batch: ``world / sp``."""
        return max(1, self.world // self.sp)

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.world / self.gpus_per_node))


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the model as built: ``total``; ``linear`` (weights autocast casts per forward);
    ``largest_unit`` (the biggest block FSDP gathers at once); ``root`` (not in any block: embeddings, final
    norm, head, which FSDP2's root keeps gathered); ``largest_tensor`` (for a per-parameter optimizer loop).

    Frozen parameters (LoRA's base) have no gradient and no optimizer state: ``trainable`` counts the others
    (``None``: all), ``frozen_bytes`` is what the frozen ones are held in.

    ``expert``: parameters a model marks as split by expert parallelism (modules with ``expert_parameters()``);
    ``largest_unit_expert``: those in the largest unit (a rank gathers only its ``1 / ep`` of them)."""

    total: int
    linear: int
    largest_unit: int
    root: int
    largest_tensor: int
    trainable: int | None = None
    frozen_bytes: float = 0.0
    expert: int = 0
    largest_unit_expert: int = 0

    def unit_on_rank(self, ep: int) -> float:
        """Parameters of the largest unit one rank gathers when the experts are split over ``ep`` ranks."""
        return self.largest_unit - self.largest_unit_expert * (1 - 1 / max(ep, 1))

    def on_rank(self, ep: int) -> float:
        """Parameters one rank computes with (all of them, but only ``1 / ep`` of the experts)."""
        return self.total - self.expert * (1 - 1 / max(ep, 1))


@dataclass
class StateMemory:
    """Bytes per GPU held for the parameters, gradients and optimizer, by named part, in the two phases of
    a step: ``forward_backward`` (besides activations) and ``optimizer_step``."""

    persistent: dict[str, float] = field(default_factory=dict)
    forward_backward: dict[str, float] = field(default_factory=dict)
    optimizer_step: dict[str, float] = field(default_factory=dict)


def optimizer_states(target: str | None, momentum: float | None = None) -> int:
    """Per-parameter state tensors of an optimizer class path: Adam-family 2, SGD with momentum 1, else 0."""
    name = (target or "").rsplit(".", 1)[-1].lower()
    if "lion" in name:
        return 1
    if "adam" in name or "lamb" in name:
        return 2
    if "sgd" in name:
        return 1 if momentum else 0
    return 2  # unknown optimizers are assumed to be Adam-like, the common and the expensive case


def state_memory(
    counts: ParamCounts,
    layout: Layout,
    master_bytes: int,
    weight_bytes: float,
    reduce_bytes: int,
    amp: bool,
    compute_bytes: int,
    optimizer_state_tensors: int,
    num_microbatches: int,
    foreach_step: bool = True,
) -> StateMemory:
    """Bytes per GPU for parameters, gradients and optimizer state.

    Args:
        master_bytes: dtype of the (trainable) parameters as built (the optimizer's copy; FSDP shards these).
        weight_bytes: dtype of the parameters in forward (FSDP's ``param_dtype``; else ``master_bytes``).
        reduce_bytes: dtype gradients are reduced (and FSDP accumulates unsharded gradients) in.
        amp: autocast is on; with parameters in forward wider than ``compute_bytes``, autocast keeps a
            ``compute_bytes`` copy of every linear weight for backward.
        optimizer_state_tensors: per-parameter state tensors (:func:`optimizer_states`).
        num_microbatches: gradient accumulation steps per optimizer step. With ``layout.reduce_every_microbatch``
            each micro batch is reduce-scattered into the sharded gradients; otherwise FSDP2 skips the
            reduce-scatter for all but the last (``set_requires_gradient_sync(False)``) and keeps unsharded
            gradients in ``reduce_bytes`` between micro batches.
        foreach_step: the optimizer updates all parameters at once (torch's default on GPUs), allocating one
            parameter-sized temporary; otherwise it loops over tensors.
    """
    p = counts.total
    t = p if counts.trainable is None else counts.trainable
    s = StateMemory()
    sharded = layout.kind in ("fsdp", "hsdp") and layout.shard > 1
    shard = layout.shard if sharded else 1
    s.persistent["parameters"] = (t * master_bytes + counts.frozen_bytes) / shard
    s.persistent["gradients"] = t * master_bytes / shard
    s.persistent["optimizer state"] = optimizer_state_tensors * t * master_bytes / shard
    if layout.kind == "ddp" and layout.world > 1:
        # DistributedDataParallel's buckets are a second copy of the gradients (gradient_as_bucket_view=False).
        s.persistent["ddp gradient buckets"] = t * master_bytes
    if sharded:
        # Under expert parallelism a rank gathers only its own experts (the other ``shard / ep`` hold them).
        local = counts.on_rank(layout.ep)
        unit = counts.unit_on_rank(layout.ep)
        units = local - counts.root
        gathered = counts.root + (2 * unit if layout.reshard_after_forward else units)
        s.forward_backward["gathered parameters"] = min(local, gathered) * weight_bytes
        s.forward_backward["reduce-scatter buffers"] = 2 * unit * (weight_bytes + reduce_bytes)
        if num_microbatches > 1 and not layout.reduce_every_microbatch:
            s.forward_backward["unsharded accumulated gradients"] = local * reduce_bytes
    if amp and weight_bytes > compute_bytes:
        s.forward_backward["autocast weight copies"] = counts.linear * compute_bytes

    temp = t * master_bytes / shard if foreach_step else counts.largest_tensor * master_bytes
    s.optimizer_step["optimizer temporaries"] = temp if optimizer_state_tensors else 0.0
    return s


@dataclass
class StepTime:
    """A roofline step: per micro batch ``max(compute, exposed communication)`` (FSDP and DDP overlap their
    collectives with compute), plus the memory-bound optimizer step."""

    compute_s: float
    communication_s: float
    optimizer_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float


def collective_seconds(
    counts: ParamCounts,
    layout: Layout,
    gpu: Accelerator,
    weight_bytes: int,
    reduce_bytes: int,
    num_microbatches: int,
    all_to_all_bytes: float = 0.0,
) -> float:
    """Seconds of collectives per optimizer step at the accelerator's assumed bus bandwidths.

    FSDP: all-gather of the parameters in forward (and again in backward when resharding), per micro batch;
    a reduce-scatter of the gradients per micro batch (``layout.reduce_every_microbatch``) or per step; HSDP adds
    an all-reduce of the shards over the replicas as often; DDP all-reduces the gradients once per step. Under
    expert parallelism the expert parameters travel only among the ``shard / ep`` ranks that shard each
    expert; ``all_to_all_bytes`` (what one GPU sends per micro batch, e.g. routed tokens) goes at the bandwidth
    of an ``ep`` group.
    """
    p = counts.total
    crosses_nodes = layout.nodes > 1

    def bandwidth(group: int) -> float:
        inside = group <= layout.gpus_per_node
        return gpu.intra_node_bw if inside or not crosses_nodes else gpu.inter_node_bw

    seconds = 0.0
    if layout.kind in ("fsdp", "hsdp") and layout.shard > 1:
        s, ep = layout.shard, max(layout.ep, 1)
        ring = (s - 1) / s
        gathers = 2 if layout.reshard_after_forward else 1
        reductions = num_microbatches if layout.reduce_every_microbatch else 1
        dense = p - counts.expert
        seconds += num_microbatches * gathers * (dense - counts.root) * weight_bytes * ring / bandwidth(s)
        seconds += num_microbatches * counts.root * weight_bytes * ring / bandwidth(s)
        seconds += reductions * dense * reduce_bytes * ring / bandwidth(s)
        if counts.expert:
            e_group = max(s // ep, 1)
            e_ring = (e_group - 1) / e_group
            local = counts.expert / ep
            seconds += num_microbatches * gathers * local * weight_bytes * e_ring / bandwidth(e_group)
            seconds += reductions * local * reduce_bytes * e_ring / bandwidth(e_group)
        if ep > 1 and all_to_all_bytes:
            seconds += num_microbatches * all_to_all_bytes * (ep - 1) / ep / bandwidth(ep)
        if layout.replicate > 1:
            r = layout.replicate
            seconds += reductions * 2 * (p / s) * reduce_bytes * (r - 1) / r / bandwidth(layout.world)
    elif layout.kind == "ddp" and layout.world > 1:
        w = layout.world
        seconds += 2 * p * reduce_bytes * (w - 1) / w / bandwidth(w)
    return seconds


def roofline(
    flops_per_micro: float,
    hardware_flops_per_micro: float,
    tokens_per_micro: int,
    num_microbatches: int,
    communication_s: float,
    counts: ParamCounts,
    layout: Layout,
    gpu: Accelerator,
    dtype: str,
    efficiency: float,
    master_bytes: int,
    fp8_share: float = 0.0,
) -> StepTime:
    """Step time, tokens/s per GPU and MFU for one optimizer step on one GPU.

    Compute runs at ``efficiency * peak[dtype]``; communication is spread evenly over the micro batches and
    overlaps with their compute; the optimizer step reads and writes about 10 values per parameter shard at the
    memory bandwidth. MFU counts ``flops_per_micro`` (LLM Foundry's 3x-forward formula) against the peak;
    HFU counts the recomputed FLOPs too. ``fp8_share`` of the FLOPs (the float8 linear layers' GEMMs) runs at the
    ``fp8`` peak instead; MFU and HFU stay against the ``dtype`` peak, so fp8 and bf16 runs compare directly.
    """
    peak = gpu.peak_flops[dtype]
    sp = layout.sp
    seconds_per_flop = (1 - fp8_share) / peak + (fp8_share / gpu.peak_flops["fp8"] if fp8_share else 0.0)
    compute = hardware_flops_per_micro / sp * seconds_per_flop / efficiency
    comm = communication_s / max(num_microbatches, 1)
    per_micro = max(compute, comm)
    shard = layout.shard if layout.kind in ("fsdp", "hsdp") else 1
    optimizer = 10 * counts.total / shard * master_bytes / gpu.memory_bw if gpu.memory_bw else 0.0
    step = num_microbatches * per_micro + optimizer
    tokens = num_microbatches * tokens_per_micro / sp
    return StepTime(
        compute_s=num_microbatches * compute,
        communication_s=communication_s,
        optimizer_s=optimizer,
        step_s=step,
        tokens_per_s_per_gpu=tokens / step,
        mfu=num_microbatches * flops_per_micro / sp / (step * peak),
        hfu=num_microbatches * hardware_flops_per_micro / sp / (step * peak),
    )
