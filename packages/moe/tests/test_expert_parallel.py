"""Expert parallelism over 2 gloo ranks equals the single-process layer, outputs and gradients."""

import pytest
import torch
import torch.distributed as dist

from smalti.moe import MoE

KW = dict(hidden_size=16, ffn_hidden_size=12, num_experts=4, top_k=2, mlp_type="glu", activation="silu")


@pytest.mark.world_size(2)
def test_expert_parallel_matches_single_process():
    """Experts split over the ``ep`` dimension of a device mesh; tokens travel by gloo all-to-all."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    torch.manual_seed(0)
    full = MoE(**KW)  # the same weights on both ranks
    torch.manual_seed(0)
    ep = MoE(expert_group=init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)), **KW)
    assert ep.num_local_experts == 2 and ep.w1.shape[0] == 2
    with torch.no_grad():
        ep.router.gate.weight.copy_(full.router.gate.weight)
        ep.w1.copy_(full.w1[2 * rank : 2 * rank + 2])
        ep.w2.copy_(full.w2[2 * rank : 2 * rank + 2])
    inputs = [torch.randn(11, 16, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    x = inputs[rank].clone().requires_grad_()
    y, aux = ep(x)
    (y.square().sum() + aux).backward()

    # One process with both ranks' tokens, trained on the mean of the two ranks' losses.
    ref_x = [inp.clone().requires_grad_() for inp in inputs]
    ref_out = [full(rx) for rx in ref_x]
    (sum(o.square().sum() + a for o, a in ref_out) / 2).backward()

    torch.testing.assert_close(y, ref_out[rank][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, 2 * ref_x[rank].grad, rtol=1e-5, atol=1e-6)  # this rank's own loss
    # This rank's experts saw both ranks' tokens: their gradient is the full layer's for those experts.
    torch.testing.assert_close(ep.w1.grad, full.w1.grad[2 * rank : 2 * rank + 2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ep.w2.grad, full.w2.grad[2 * rank : 2 * rank + 2], rtol=1e-5, atol=1e-6)
    # The router is replicated: its gradients, averaged over ranks as data parallelism does, match.
    router_grad = ep.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)
    torch.testing.assert_close(router_grad / 2, full.router.gate.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.world_size(2)
def test_aux_free_counts_are_summed_over_ranks():
    from smalti.moe.balancing import update_expert_biases

    torch.manual_seed(0)
    layer = MoE(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=1, load_balancing="aux_free")
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[dist.get_rank(), 0] = 5.0  # rank 0 sends all to expert 0, rank 1 to expert 1
    layer(torch.randn(10, 8).abs())
    update_expert_biases(layer, coeff=0.1)
    bias = layer.router.expert_bias
    assert bias[0] == bias[1] and bias[0] < 0 and (bias[2:] > 0).all()  # the same on both ranks
