"""The accelerators ``smalti plan`` knows, and the assumptions it makes about what a run achieves on them.

Peak figures are the vendors' dense (no sparsity) numbers for the SXM parts; the achieved fractions and the
bandwidths a collective really gets are assumptions, printed with every plan and overridable
(``plan.efficiency``, ``plan.intra_node_gbps``, ``plan.inter_node_gbps``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class Accelerator:
    """One device type: memory, dense peak FLOP/s by dtype, and collective bandwidth per GPU (bytes/s)."""

    name: str
    memory_bytes: float
    #: Memory not available to tensors: CUDA context, NCCL buffers, allocator fragmentation.
    reserved_bytes: float
    peak_flops: dict[str, float]
    #: Bus bandwidth an NCCL all-gather/reduce-scatter reaches inside one node (NVLink), bytes/s per GPU.
    intra_node_bw: float
    #: The same across nodes (one InfiniBand/RoCE NIC per GPU), bytes/s per GPU.
    inter_node_bw: float
    #: Memory bandwidth (bytes/s): the optimizer step is bound by it.
    memory_bw: float = 0.0
    description: str = ""


ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator(
        "h100", 80 * GiB, 3 * GiB,
        {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12, "fp8": 1978.9e12},
        intra_node_bw=360e9, inter_node_bw=40e9, memory_bw=3.35e12,
        description="H100 SXM 80GB; NVLink 4 (450 GB/s per direction, ~360 GB/s bus bandwidth assumed), "
                    "400 Gb/s NIC per GPU (~40 GB/s assumed)",
    ),
    "a100": Accelerator(
        "a100", 80 * GiB, 3 * GiB,
        {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        intra_node_bw=230e9, inter_node_bw=20e9, memory_bw=2.04e12,
        description="A100 SXM 80GB; NVLink 3 (300 GB/s per direction, ~230 GB/s bus bandwidth assumed), "
                    "200 Gb/s NIC per GPU (~20 GB/s assumed)",
    ),
    "h200": Accelerator(
        "h200", 141e9, 3 * GiB,
        {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12, "fp8": 1978.9e12},
        intra_node_bw=360e9, inter_node_bw=40e9, memory_bw=4.8e12,
        description="H200 SXM 141GB; compute as H100; NVLink 4 (~360 GB/s bus bandwidth assumed), "
                    "400 Gb/s NIC per GPU (~40 GB/s assumed)",
    ),
    # A 24 GB card, the single-GPU QLoRA target: dense peaks from NVIDIA's L4 datasheet (half the sparse ones).
    "l4": Accelerator(
        "l4", 24 * GiB, 2 * GiB,
        {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12, "fp8": 242.5e12},
        intra_node_bw=25e9, inter_node_bw=12e9, memory_bw=0.3e12,
        description="L4 24GB; PCIe Gen4 x16 between GPUs (~25 GB/s bus bandwidth assumed, no NVLink), "
                    "100 Gb/s NIC (~12 GB/s assumed)",
    ),
}

#: Fraction of the dense peak that a well-tuned transformer step sustains (matrix products, attention and
#: everything else averaged): LLM Foundry's published H100 MFUs for 1b-70b lie at 35-47%, A100's at 43-64%.
DEFAULT_EFFICIENCY = {"h100": 0.45, "h200": 0.45, "a100": 0.55, "l4": 0.45, "cpu": 1.0}


def cpu_accelerator() -> Accelerator:
    """This machine's CPU as a planning target: its physical memory, no FLOP/s figures (no step time)."""
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        memory = float("inf")
    return Accelerator("cpu", memory, 0.0, {}, 0.0, 0.0, description="this machine's CPU and RAM (memory only)")


def get_accelerator(name: str) -> Accelerator:
    """The accelerator called ``name`` (h100, a100, h200, l4 or cpu)."""
    from smalti.core.errors import ConfigError

    key = str(name).lower()
    if key == "cpu":
        return cpu_accelerator()
    if key not in ACCELERATORS:
        raise ConfigError(f"plan.gpu={name!r} is not one of {', '.join([*ACCELERATORS, 'cpu'])}")
    return ACCELERATORS[key]
