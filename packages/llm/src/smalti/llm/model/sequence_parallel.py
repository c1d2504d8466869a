"""Ulysses sequence parallelism: each rank of an ``sp`` group holds a contiguous chunk of every sequence.

Around attention, an all-to-all trades the sequence split for a head split (``[B, T/sp, H, D]`` to
``[B, T, H/sp, D]``), so each rank attends over the whole sequence for ``H/sp`` heads; a second all-to-all
trades back. Everything else in the model (embeddings, norms, FFN, output head, loss) works on the rank's
own chunk. Gradients flow through both all-to-alls (``torch.distributed.nn`` makes them differentiable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceParallelGroup:
    """The ranks that split one sequence: a process group, its size and this rank's place in it."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def from_group(cls, group: dist.ProcessGroup) -> SequenceParallelGroup:
        """Wrap ``group`` (every rank of it must hold the same samples)."""
        return cls(group=group, size=dist.get_world_size(group), rank=dist.get_rank(group))

    def chunk(self, seq_len: int) -> tuple[int, int]:
        """``(start, stop)`` of this rank's share of a sequence of ``seq_len`` positions."""
        local = seq_len // self.size
        return self.rank * local, (self.rank + 1) * local

    def heads(self, n_heads: int) -> tuple[int, int]:
        """``(start, stop)`` of the heads this rank attends with after the all-to-all."""
        local = n_heads // self.size
        return self.rank * local, (self.rank + 1) * local


class _AllToAll(torch.autograd.Function):
    """All-to-all over dim 0 with equal splits; its gradient is the same exchange in reverse (another one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    # empty_like would keep a permuted layout; the collective reads and writes plain row-major buffers.
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all over dim 0 of ``x`` (``x[i]`` goes to rank ``i``, ``out[j]`` came from rank ``j``)."""
    return _AllToAll.apply(x.contiguous(), group)


def sequence_to_heads(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """``[B, T/sp, H, D]`` (this rank's positions, all heads) to ``[B, T, H/sp, D]`` (all positions, its heads)."""
    b, t_local, h, d = x.shape
    chunks = x.view(b, t_local, sp.size, h // sp.size, d).permute(2, 0, 1, 3, 4)  # [sp, B, T/sp, H/sp, D]
    received = _all_to_all(chunks, sp.group)  # received[j]: rank j's positions, this rank's heads
    return received.permute(1, 0, 2, 3, 4).reshape(b, sp.size * t_local, h // sp.size, d)


def heads_to_sequence(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """``[B, T, H/sp, D]`` back to ``[B, T/sp, H, D]``: the inverse of :func:`sequence_to_heads`."""
    b, t, h_local, d = x.shape
    t_local = t // sp.size
    chunks = x.view(b, sp.size, t_local, h_local, d).permute(1, 0, 2, 3, 4)  # [sp, B, T/sp, H/sp, D]
    received = _all_to_all(chunks, sp.group)  # received[j]: this rank's positions, rank j's heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, t_local, sp.size * h_local, d)
