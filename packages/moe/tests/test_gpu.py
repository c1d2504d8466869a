"""Tier 3 (GPU only): the Triton backend compiled for real in bf16, against the fp32 reference, and determinism.

Tolerance: bf16 keeps 8 bits of mantissa (relative step 2**-8 ~ 4e-3); outputs are sums of about
``hidden`` products accumulated in fp32, so errors of a few bf16 ulps are expected: rtol=2e-2, atol=2e-2
on unit-scale outputs.
"""

import pytest
import torch

from smalti.moe import MoE

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
def test_triton_bf16_matches_reference(mlp_type):
    kw = dict(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2, mlp_type=mlp_type,
              activation="silu" if mlp_type == "glu" else "gelu", device="cuda")
    torch.manual_seed(0)
    ref = MoE(backend="torch", **kw)
    torch.manual_seed(0)
    tri = MoE(backend="triton", dtype=torch.bfloat16, **kw)
    x = torch.randn(1024, 256, device="cuda")
    y_ref, _ = ref(x)
    y_tri, _ = tri(x.bfloat16())
    torch.testing.assert_close(y_tri.float(), y_ref, rtol=2e-2, atol=2e-2)


def test_triton_is_deterministic():
    torch.manual_seed(0)
    layer = MoE(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2, backend="triton", device="cuda",
                dtype=torch.bfloat16)
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for _ in range(2):
        x.grad = None
        layer.zero_grad()
        y, _ = layer(x)
        y.float().square().sum().backward()
        outs.append((y.detach().clone(), x.grad.clone(), layer.w1.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
