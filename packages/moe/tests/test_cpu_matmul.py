"""The pluggable CPU product of the torch backend's expert GEMMs (``ops.set_cpu_matmul``)."""

import pytest
import torch

from smalti.moe import MoE, ops, reference
from smalti.moe.cpu_matmul import cpu_matmul, for_operands, get_cpu_matmul


class CountingMatmul:
    """A stand-in for smalti-core's ``matmul_into``: the same signature, torch's product, every call recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.copies = 0

    def __call__(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool = False
                 ) -> torch.Tensor:
        assert out.dim() == a.dim() == b.dim() == 2
        # per expert slice, views of the layer's tensors: a view of a larger tensor has a _base
        self.copies += sum(t._base is None for t in (out, a, b))
        # a weight gradient writes one expert's [K, M] slab of a 3-D gradient from a transposed row block
        self.calls.append("wgrad" if out._base is not None and out._base.dim() == 3 else "rows")
        if accumulate:
            return out.addmm_(a, b)
        return torch.mm(a, b, out=out)


def _step(layer: MoE, x: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y, _ = layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, layer.w1.grad.clone(), layer.w2.grad.clone(), layer.router.gate.weight.grad.clone()


@pytest.mark.parametrize(("mlp_type", "activation"), [("glu", "silu"), ("mlp", "gelu")])
def test_installed_product_gives_torchs_outputs_and_grads_and_runs_every_expert_product(mlp_type, activation):
    torch.manual_seed(0)
    layer = MoE(hidden_size=32, ffn_hidden_size=24, num_experts=4, top_k=2, mlp_type=mlp_type, activation=activation)
    x = torch.randn(40, 32)
    expected = _step(layer, x)
    fake = CountingMatmul()
    with cpu_matmul(fake):
        got = _step(layer, x)
    assert get_cpu_matmul() is None  # restored after the block
    for name, e, g in zip(("y", "dx", "dw1", "dw2", "drouter"), expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)
    routed = torch.unique(layer.router(x).expert_ids).numel()
    assert routed == 4
    # per expert: two forward products, two input-gradient products, two weight-gradient products
    assert len(fake.calls) == 6 * routed and fake.calls.count("wgrad") == 2 * routed
    assert fake.copies == 0


def test_expert_no_token_reaches_gets_zero_gradient_through_the_installed_product():
    torch.manual_seed(0)
    layer = MoE(hidden_size=24, ffn_hidden_size=16, num_experts=4, top_k=1)
    with torch.no_grad():
        layer.router.gate.weight[3] = -100.0  # with positive inputs, expert 3 is never chosen
    x = torch.randn(20, 24).abs()
    fake = CountingMatmul()
    with cpu_matmul(fake):
        grad = reference.grouped_mm_wgrad(x, torch.randn(20, 8), torch.tensor([5, 12, 20, 20]))
        y, _ = layer(x)
        y.sum().backward()
    assert len(fake.calls) == 3 + 5 * 3  # x needs no gradient: no input-gradient product for the first GEMM
    assert grad[3].abs().sum() == 0 and grad[:3].abs().sum() > 0
    assert layer.w1.grad[3].abs().sum() == 0 and layer.w1.grad[:3].abs().sum() > 0


def test_set_cpu_matmul_returns_the_previous_and_rejects_a_non_callable():
    fake = CountingMatmul()
    assert ops.set_cpu_matmul(fake) is None
    try:
        assert ops.get_cpu_matmul() is fake
        with pytest.raises(TypeError, match="callable"):
            ops.set_cpu_matmul("openblas")
    finally:
        assert ops.set_cpu_matmul(None) is fake


def test_only_cpu_operands_reach_the_installed_product():
    with cpu_matmul(CountingMatmul()):
        assert for_operands(torch.empty(2, 2)) is not None
        assert for_operands(torch.empty(2, 2), torch.empty(2, 2, device="meta")) is None
    assert for_operands(torch.empty(2, 2)) is None
