"""``smalti plan <overrides>``: per-GPU memory and a roofline step time for a run, before a cluster is booked.

The run config is composed as ``smalti-train`` would compose it; ``plan.*`` keys (see :data:`PLAN_KEYS`)
say what to plan for. The model is built on the meta device (no memory); the parallelism and precision
configs give the per-GPU share of parameters, gradients and optimizer state (:mod:`.estimate`); the model's
package answers the ``smalti_plan_model`` hook with activation bytes and FLOPs.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from smalti.core.errors import ConfigError
from smalti.core.plan.estimate import (
    Layout,
    ParamCounts,
    StateMemory,
    StepTime,
    collective_seconds,
    optimizer_states,
    roofline,
    state_memory,
)
from smalti.core.plan.hardware import DEFAULT_EFFICIENCY, Accelerator, GiB, get_accelerator
from smalti.core.plan.types import ModelEstimate, PlanSetup

#: ``plan.<key>=<value>`` options and their defaults. ``gpus`` is per node, as torchrun's --nproc-per-node.
PLAN_KEYS: dict[str, Any] = {
    "gpu": "h100",
    "gpus": None,  # per node; default 8, or 1 under parallelism=single
    "nodes": 1,
    "micro_batch_size": None,  # default: trainer.device_train_microbatch_size
    "efficiency": None,  # achieved fraction of the dense peak; default per GPU (hardware.DEFAULT_EFFICIENCY)
    "intra_node_gbps": None,  # GB/s bus bandwidth inside a node; default per GPU
    "inter_node_gbps": None,  # GB/s across nodes; default per GPU
    "sequence_id": False,  # batches carry sequence_id (packed documents masked from each other)
}
_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, None: None}


@dataclass
class Plan:
    """A computed plan: the inputs as understood, memory by part (bytes per GPU), and the roofline."""

    description: list[str]
    layout: Layout
    gpu: Accelerator
    counts: ParamCounts
    micro_batch_size: int
    per_gpu_batch: int
    num_microbatches: int
    memory: dict[str, float]
    peak_forward_backward: float
    peak_optimizer_step: float
    budget: float
    largest_fitting_micro_batch: int | None
    activations_known: bool
    step: StepTime | None = None
    assumptions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(self.peak_forward_backward, self.peak_optimizer_step)

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget


def split_overrides(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Separate ``plan.<key>=<value>`` options (typed like their defaults) from the run's overrides."""
    options = dict(PLAN_KEYS)
    rest: list[str] = []
    for item in overrides:
        key, sep, value = item.lstrip("+").partition("=")
        if not key.startswith("plan."):
            rest.append(item)
            continue
        name = key[len("plan."):]
        if name not in PLAN_KEYS or not sep:
            raise ConfigError(
                f"`{item}` is not a plan option; use plan.<key>=<value> with key one of {', '.join(PLAN_KEYS)}"
            )
        options[name] = _typed(name, value)
    return options, rest


def _typed(name: str, value: str) -> Any:
    default = PLAN_KEYS[name]
    try:
        if name in ("gpus", "nodes", "micro_batch_size"):
            number = int(value)
            if number < 1:
                raise ValueError
            return number
        if name in ("efficiency", "intra_node_gbps", "inter_node_gbps"):
            number = float(value)
            if number <= 0:
                raise ValueError
            return number
    except ValueError:
        raise ConfigError(f"plan.{name}={value!r} must be a positive number") from None
    if isinstance(default, bool):
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"plan.{name}={value!r} must be true or false")
        return value.lower() == "true"
    return value


def compose(overrides: list[str]) -> Any:
    """The run config ``smalti-train <overrides>`` would use."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from smalti.core.config.schema import register_configs

    register_configs()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def build(node: Any, key: str) -> Any:
    """Instantiate one config node, naming its key when that fails (no trainer imports: planning is light)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import DictConfig

    if node is None or (isinstance(node, DictConfig) and "_target_" not in node):
        return None
    try:
        return instantiate(node)
    except InstantiationException as exc:
        raise ConfigError(f"could not build `{key}` ({node.get('_target_')}): {exc}") from exc


def build_on_meta(node: Any) -> nn.Module:
    """Build the config's model on the meta device: shapes and parameter counts, no memory."""
    from omegaconf import OmegaConf

    if "init_device" in node:
        node = OmegaConf.merge(node, {"init_device": "meta"})
    with torch.device("meta"):
        model = build(node, "model")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"`model` built a {type(model).__name__}, not a torch.nn.Module; smalti plan needs one")
    return model


def count_parameters(model: nn.Module) -> ParamCounts:
    """Parameter counts of ``model`` (tied parameters once), by the parts FSDP treats differently."""
    from smalti.core.parallelism.fsdp import shard_units

    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    linear_ids = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    # autocast keeps a half copy of a linear weight wider than half precision (a frozen bf16 base needs none)
    linear = sum(p.numel() for p in params if id(p) in linear_ids and p.element_size() > 2)
    frozen = [p for p in params if not p.requires_grad]
    units = shard_units(model)
    unit_sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    unit_experts = [_expert_count(unit) for unit in units]
    largest = max(range(len(units)), key=unit_sizes.__getitem__, default=None)
    return ParamCounts(
        total=total,
        linear=linear,
        largest_unit=max(unit_sizes, default=0),
        root=total - sum(unit_sizes),
        largest_tensor=max((p.numel() for p in params if p.requires_grad), default=0),
        trainable=total - sum(p.numel() for p in frozen),
        frozen_bytes=float(sum(p.numel() * p.element_size() for p in frozen)),
        expert=_expert_count(model),
        largest_unit_expert=unit_experts[largest] if largest is not None else 0,
    )


def _expert_count(module: nn.Module) -> int:
    """Parameters of ``module`` that expert parallelism splits: those its submodules list in an
    ``expert_parameters()`` method (the protocol of smalti-moe's layer; core names no MoE class)."""
    seen: set[int] = set()
    for sub in module.modules():
        listed = getattr(sub, "expert_parameters", None)
        if callable(listed):
            seen.update(id(p) for p in listed())
    return sum(p.numel() for p in module.parameters() if id(p) in seen)


def layout_of(parallelism: Any, world: int, gpus_per_node: int) -> Layout:
    """The :class:`Layout` of a built parallelism plugin on ``world`` GPUs."""
    from smalti.core.parallelism import DDP, FSDP, HSDP, SingleDevice

    sp = int(getattr(parallelism, "sp", 1) or 1)
    if world % sp:
        raise ConfigError(f"parallelism.sp={sp} does not divide the planned world size {world} (plan.gpus x plan.nodes)")
    ep = int(getattr(parallelism, "ep", 1) or 1)
    if world % ep:
        raise ConfigError(f"parallelism.ep={ep} does not divide the planned world size {world} (plan.gpus x plan.nodes)")
    if isinstance(parallelism, HSDP):
        replicate, shard = parallelism.mesh_shape(world)
        return Layout("hsdp", world, gpus_per_node, shard, replicate, sp, parallelism.reshard_after_forward,
                      parallelism.reduce_every_microbatch)
    if isinstance(parallelism, FSDP):
        return Layout("fsdp", world, gpus_per_node, world, 1, sp, parallelism.reshard_after_forward,
                      parallelism.reduce_every_microbatch, ep)
    if isinstance(parallelism, DDP):
        return Layout("ddp", world, gpus_per_node, 1, world, sp)
    if isinstance(parallelism, SingleDevice) or parallelism is None:
        if world > 1:
            raise ConfigError(
                f"parallelism=single runs on one device, but the plan is for {world} GPUs; choose parallelism=ddp, "
                "fsdp or hsdp, or plan.gpus=1"
            )
        return Layout("single", 1, gpus_per_node)
    raise ConfigError(f"smalti plan does not know parallelism {type(parallelism).__name__}; use single, ddp, fsdp or hsdp")


def _dtype_name(nbytes: int | None, precision: str) -> str:
    if nbytes == 4:
        return "fp32"
    return "fp16" if precision == "amp_fp16" else "bf16"


def make_plan(overrides: list[str], pm: Any = None) -> Plan:
    """Compose the run, build the model on meta, and compute its plan (see the module docstring)."""
    from smalti.core.plugins import get_plugin_manager

    options, rest = split_overrides(overrides)
    cfg = compose(rest)
    gpu = get_accelerator(options["gpu"])
    parallelism = build(cfg.parallelism, "parallelism")
    single = parallelism is None or type(parallelism).__name__ == "SingleDevice"
    gpus_per_node = options["gpus"] or (1 if single else 8)
    if gpu.name == "cpu":
        gpus_per_node = 1
    world = gpus_per_node * (options["nodes"] if gpu.name != "cpu" else 1)
    intra, inter = options["intra_node_gbps"], options["inter_node_gbps"]
    if intra or inter:
        gpu = replace(gpu, intra_node_bw=(intra or gpu.intra_node_bw / 1e9) * 1e9,
                      inter_node_bw=(inter or gpu.inter_node_bw / 1e9) * 1e9)
    layout = layout_of(parallelism, world, gpus_per_node)
    precision = str(cfg.trainer.precision)
    model = build_on_meta(cfg.model)
    counts = count_parameters(model)
    master = next((p.element_size() for p in model.parameters() if p.requires_grad), 4)
    policy = getattr(parallelism, "mp_policy", None)
    weight = _BYTES[getattr(policy, "param_dtype", None)] or master
    reduce = _BYTES[getattr(policy, "reduce_dtype", None)] or weight
    autocast = 2 if precision in ("amp_bf16", "amp_fp16", "amp_fp8") else None
    compute = min(weight, autocast or weight)

    global_batch = int(cfg.data.global_train_batch_size)
    per_gpu = max(1, math.ceil(global_batch / layout.dp))
    micro_opt = options["micro_batch_size"] or cfg.trainer.device_train_microbatch_size
    auto = micro_opt == "auto"
    micro = per_gpu if (micro_opt is None or auto) else min(int(micro_opt), per_gpu)

    pm = pm or get_plugin_manager()
    opt_cfg = cfg.get("optimizer") or {}
    states = optimizer_states(opt_cfg.get("_target_"), opt_cfg.get("momentum"))

    def setup(m: int) -> PlanSetup:
        return PlanSetup(cfg, m, compute, weight, autocast, weight, layout.sp, layout.ep, gpu.name, world,
                         bool(options["sequence_id"]), _experiment_name(rest))

    def estimate(m: int) -> ModelEstimate | None:
        return pm.hook.smalti_plan_model(model=model, setup=setup(m))

    first = estimate(1)
    if first is not None and first.frozen_bytes is not None:
        counts = replace(counts, frozen_bytes=first.frozen_bytes)

    def memory_for(m: int) -> tuple[StateMemory, ModelEstimate | None]:
        n_micro = math.ceil(per_gpu / m)
        state = state_memory(counts, layout, master, weight, reduce, autocast is not None, compute, states, n_micro,
                             foreach_step=gpu.name != "cpu")
        return state, estimate(m)

    def peaks(m: int) -> tuple[float, float]:
        state, est = memory_for(m)
        base = sum(state.persistent.values())
        acts = sum(est.activations.values()) if est else 0.0
        return base + sum(state.forward_backward.values()) + acts, base + sum(state.optimizer_step.values())

    budget = gpu.memory_bytes - gpu.reserved_bytes
    fitting = [m for m in range(1, per_gpu + 1) if max(peaks(m)) <= budget]
    largest = max(fitting) if fitting else None
    if auto and largest:
        micro = largest
    n_micro = math.ceil(per_gpu / micro)
    state, est = memory_for(micro)
    memory: dict[str, float] = {**state.persistent, **state.forward_backward}
    if est is not None:
        memory.update({f"activations: {k}": v for k, v in est.activations.items()})
    peak_fb, peak_step = peaks(micro)

    desc = [
        f"run: {' '.join(rest) or '(defaults)'}",
        f"hardware: {layout.nodes} node(s) x {gpus_per_node} {gpu.name.upper()} = {world} GPU(s); {gpu.description}",
        f"parallelism: {_layout_text(layout)}; precision {precision}; parameters {_dtype_name(master, precision)} "
        f"master, {_dtype_name(weight, precision)} in forward, gradients reduced in {_dtype_name(reduce, precision)}",
        f"model: {type(model).__name__}, {counts.total / 1e6:,.1f} M parameters ({counts.linear / 1e6:,.1f} M in "
        f"linear layers, largest block {counts.largest_unit / 1e6:,.1f} M)",
        *([f"experts: {counts.expert / 1e6:,.1f} M parameters split over ep={layout.ep} "
           f"({counts.on_rank(layout.ep) / 1e6:,.1f} M computed with per rank)"] if counts.expert else []),
        *([f"frozen: {(counts.total - counts.trainable) / 1e6:,.1f} M parameters held in "
           f"{counts.frozen_bytes / 2**30:,.2f} GiB (no gradient, no optimizer state); {counts.trainable / 1e6:,.2f} M "
           "train"] if counts.trainable is not None and counts.trainable < counts.total else []),
        f"batch: global {global_batch} = {layout.dp} data-parallel x {per_gpu} per GPU; micro batch {micro}"
        f"{' (auto: largest that fits)' if auto else ''} -> {n_micro} micro batch(es) per step",
    ]
    plan = Plan(desc, layout, gpu, counts, micro, per_gpu, n_micro, memory, peak_fb, peak_step, budget, largest,
                est is not None)
    if est is None:
        plan.notes.append(
            f"activations not estimated: no installed plugin implements smalti_plan_model for {type(model).__name__}"
        )
    else:
        plan.notes.extend(est.notes)
    if est is not None and est.flops and gpu.peak_flops:
        dtype = _dtype_name(compute, precision)
        efficiency = options["efficiency"] or DEFAULT_EFFICIENCY.get(gpu.name, 0.5)
        comm = collective_seconds(counts, layout, gpu, weight, reduce, n_micro, est.all_to_all_bytes)
        plan.step = roofline(est.flops, est.hardware_flops or est.flops, est.tokens, n_micro, comm, counts, layout,
                             gpu, dtype, efficiency, master)
        fp8_lines = []
        if precision == "amp_fp8":
            bf16_step = plan.step
            share, gathered = fp8_shares(cfg, model, counts, est)
            if "fp8" not in gpu.peak_flops:
                raise ConfigError(f"plan.gpu={gpu.name} has no FP8 tensor cores; precision=fp8 needs h100 or h200")
            weight_fp8 = weight - (weight - 1) * gathered
            comm = collective_seconds(counts, layout, gpu, weight_fp8, reduce, n_micro, est.all_to_all_bytes)
            plan.step = roofline(est.flops, est.hardware_flops or est.flops, est.tokens, n_micro, comm, counts,
                                 layout, gpu, dtype, efficiency, master, fp8_share=share)
            fp8_lines = [
                f"fp8: {share:.0%} of the FLOPs (the float8 linear layers' GEMMs) at the fp8 dense peak "
                f"({gpu.peak_flops['fp8'] / 1e12:,.1f} TFLOP/s), the rest (attention, head) in bf16; "
                f"{gathered:.0%} of the all-gathered weights travel in float8; MFU counts against the bf16 peak",
                f"fp8 against amp_bf16 at this layout: step {plan.step.step_s:.3f} s against {bf16_step.step_s:.3f} s "
                f"({bf16_step.step_s / plan.step.step_s:.2f}x), {plan.step.tokens_per_s_per_gpu:,.0f} against "
                f"{bf16_step.tokens_per_s_per_gpu:,.0f} tokens/s/GPU; memory as amp_bf16 (torchao keeps the "
                "inputs it saves for backward in bf16). The fp8 GEMMs are assumed to reach the same share of "
                "their peak as bf16 ones and the casts are not counted: torchtitan measured 1.28x (Llama 3.1 8B, "
                "8 H100, torch.compile with and without Float8: 8,532 against 6,667 tokens/s/GPU)",
            ]
        plan.assumptions = [*fp8_lines,
            f"compute at {efficiency:.0%} of the {dtype} dense peak ({gpu.peak_flops[dtype] / 1e12:,.1f} TFLOP/s) "
            f"= {efficiency * gpu.peak_flops[dtype] / 1e12:,.1f} TFLOP/s achieved (plan.efficiency)",
            f"collective bus bandwidth {gpu.intra_node_bw / 1e9:,.0f} GB/s inside a node, "
            f"{gpu.inter_node_bw / 1e9:,.0f} GB/s across nodes (plan.intra_node_gbps, plan.inter_node_gbps); "
            "collectives overlap compute",
            "FLOPs by LLM Foundry's formula: 3 x (2 x params x T + n_layers x 4 x d_model x T^2) per sequence",
        ]
        if layout.sp > 1:
            plan.assumptions.append("sequence parallelism's all-to-alls are not modelled (they add to the step)")
    return plan


def fp8_shares(cfg: Any, model: nn.Module, counts: Any, est: ModelEstimate) -> tuple[float, float]:
    """For ``precision=fp8``: the share of the training FLOPs in float8 linear layers, and the share of the
    parameters FSDP2 all-gathers in float8 (``tensorwise`` with ``fsdp_float8_all_gather``; else 0)."""
    from smalti.core.algorithms.float8 import Float8Training

    settings = dict((cfg.get("algorithms") or {}).get("float8") or {})
    settings.pop("_target_", None)
    algorithm = Float8Training(**settings)
    params = sum(m.weight.numel() for m in algorithm.layers_to_convert(model).values())
    share = min(1.0, 6 * params * est.tokens / est.flops) if est.flops else 0.0
    return share, (params / counts.total if algorithm.fsdp_float8_all_gather else 0.0)


def _experiment_name(overrides: list[str]) -> str | None:
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        if key == "experiment":
            return value
    return None


def _layout_text(layout: Layout) -> str:
    if layout.kind == "fsdp":
        text = f"fsdp (FSDP2, parameters sharded over {layout.shard}"
    elif layout.kind == "hsdp":
        text = f"hsdp ({layout.replicate} replicas x {layout.shard} shards"
    elif layout.kind == "ddp":
        text = f"ddp ({layout.world} replicas"
    else:
        return "single (one device)"
    if layout.kind in ("fsdp", "hsdp"):
        text += ", reshard after forward" if layout.reshard_after_forward else ", no reshard after forward"
        text += (", gradients reduce-scattered every micro batch" if layout.reduce_every_microbatch
                 else ", gradients reduce-scattered once per step")
    if layout.sp > 1:
        text += f", sequence parallel over {layout.sp}"
    if layout.ep > 1:
        text += f", experts split over ep={layout.ep} and sharded over the other {layout.shard // layout.ep}"
    return text + ")"


def format_plan(plan: Plan) -> str:
    """The plan as the text ``smalti plan`` prints."""
    lines = list(plan.description)
    lines.append("")
    lines.append("memory per GPU                                      GiB")
    for name, value in plan.memory.items():
        if value:
            lines.append(f"  {name:<46}{value / GiB:>9.2f}")
    lines.append(f"  {'peak in forward/backward':<46}{plan.peak_forward_backward / GiB:>9.2f}")
    lines.append(f"  {'peak in the optimizer step':<46}{plan.peak_optimizer_step / GiB:>9.2f}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"  {'total (the larger peak)':<46}{plan.peak / GiB:>9.2f}  of {plan.budget / GiB:.2f} usable "
        f"({plan.gpu.memory_bytes / GiB:.2f} - {plan.gpu.reserved_bytes / GiB:.2f} reserved): {verdict}"
    )
    if plan.largest_fitting_micro_batch is None:
        lines.append("largest micro batch that fits: none (not even 1)")
    else:
        lines.append(f"largest micro batch that fits: {plan.largest_fitting_micro_batch} "
                     f"(of {plan.per_gpu_batch} per GPU per step)")
    if plan.step is not None:
        s = plan.step
        lines.append("")
        lines.append("step time (roofline)")
        lines.append(f"  compute {s.compute_s:.3f} s, collectives {s.communication_s:.3f} s, optimizer "
                     f"{s.optimizer_s:.3f} s -> step {s.step_s:.3f} s")
        lines.append(f"  {s.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {s.mfu:.1%}, HFU {s.hfu:.1%}")
        lines.append("assumptions:")
        lines.extend(f"  {a}" for a in plan.assumptions)
    if plan.notes:
        lines.append("")
        lines.extend(plan.notes)
    return "\n".join(lines)


def main(overrides: list[str], out: Any = None) -> int:
    """``smalti plan``: print the plan for ``smalti-train <overrides>`` plus ``plan.*`` options."""
    try:
        plan = make_plan(list(overrides))
    except ConfigError as exc:
        print(f"smalti plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan), file=out or sys.stdout)
    return 0
