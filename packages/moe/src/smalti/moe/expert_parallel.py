"""Expert parallelism: experts split over a process group, tokens sent to their expert's rank by all-to-all.

Steps: sort this rank's (token, slot) entries by expert; exchange per-expert counts; send the rows with a
differentiable all-to-all; run the local experts on what arrived; send the results back the same way;
combine each token's k outputs with its routing weights. Gradients flow back through both all-to-alls, so
each rank's expert weights get the gradient from every rank's tokens.

As in MegaBlocks, the expert weights' gradients are scaled by ``1 / ep``: when the replicated parameters
(router, shared experts, the rest of the model) are averaged over the same ranks by data parallelism,
every gradient is then that of the mean of the ranks' losses, as in one process holding all the tokens.
Expert weights differ per rank, so data parallelism must leave them out of its all-reduce
(:meth:`smalti.moe.MoE.expert_parameters`).

:func:`shard_experts` turns a layer built with all its experts (on the meta device, or filled the same on every
rank) into its expert-parallel shard after construction, as a parallelism plugin does: ``w1``/``w2`` become
DTensors ``Shard(0)`` over the mesh's expert dimension, so a checkpoint or a weight loader sees which experts a
rank holds, and FSDP2 over the remaining data-parallel ranks can shard them further.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from smalti.moe import ops
from smalti.moe.errors import MoEError

if TYPE_CHECKING:
    from smalti.moe.layer import MoE


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad * ctx.scale, None


def expert_parallel_forward(layer: MoE, tokens: torch.Tensor, expert_ids: torch.Tensor,
                            weights: torch.Tensor) -> torch.Tensor:
    """The layer's expert computation with its experts spread over ``layer.expert_group``; token order kept."""
    group = layer.expert_group
    ep = dist.get_world_size(group)
    local = layer.num_local_experts
    k = expert_ids.shape[1]
    perm, counts, _ = ops.sort_by_expert(expert_ids, layer.num_experts, layer.backend)
    send_rows = ops.gather_rows(tokens, perm, k, layer.backend)
    # counts[e] for e in rank r's experts go to rank r; receive [ep, local] counts from every rank.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_matrix = recv_counts.view(ep, local)
    recv_splits = recv_matrix.sum(1).tolist()
    received = all_to_all_single(
        torch.empty(sum(recv_splits), tokens.shape[1], dtype=tokens.dtype, device=tokens.device),
        send_rows, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group,
    )
    local_ids = torch.repeat_interleave(
        torch.arange(local, device=tokens.device).repeat(ep), recv_matrix.reshape(-1)
    ).unsqueeze(1)
    ones = torch.ones_like(local_ids, dtype=received.dtype)
    w1, w2 = _ScaleGrad.apply(_local(layer.w1), 1.0 / ep), _ScaleGrad.apply(_local(layer.w2), 1.0 / ep)
    computed = layer.experts_forward(received, local_ids, ones, w1, w2)
    returned = all_to_all_single(
        torch.empty(sum(send_splits), tokens.shape[1], dtype=tokens.dtype, device=tokens.device),
        computed, output_split_sizes=send_splits, input_split_sizes=recv_splits, group=group,
    )
    return ops.scatter_rows(returned, perm, weights, k, layer.backend)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of ``weight``: the local part of an expert-sharded DTensor (differentiably)."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


def shard_experts(layer: MoE, ep_mesh: Any) -> None:
    """Split ``layer``'s routed experts over the 1-D device mesh ``ep_mesh``: rank ``r`` keeps experts
    ``r * E/ep .. (r + 1) * E/ep - 1`` of ``w1``/``w2`` as DTensors ``Shard(0)``, and tokens travel to them by
    all-to-all. The layer must hold all ``num_experts`` (built whole, on meta or identical on every rank)."""
    from torch.distributed.tensor import DTensor, Shard

    ep = ep_mesh.size()
    if layer.num_experts % ep:
        raise MoEError(f"num_experts={layer.num_experts} does not divide over ep={ep} expert-parallel ranks; "
                       f"choose an ep that divides {layer.num_experts}")
    if layer.w1.shape[0] != layer.num_experts or isinstance(layer.w1, DTensor):
        raise MoEError(f"shard_experts: the layer holds {layer.w1.shape[0]} of its {layer.num_experts} experts; "
                       "it must be built whole (no expert_group) before its experts are sharded")
    local = layer.num_experts // ep
    start = ep_mesh.get_local_rank() * local
    for name in ("w1", "w2"):
        whole = getattr(layer, name)
        part = whole.detach()[start : start + local].clone()
        sharded = DTensor.from_local(part, ep_mesh, [Shard(0)], run_check=False,
                                     shape=whole.shape, stride=whole.stride())
        setattr(layer, name, torch.nn.Parameter(sharded, requires_grad=whole.requires_grad))
    layer.expert_group = ep_mesh.get_group()
    layer.num_local_experts = local
