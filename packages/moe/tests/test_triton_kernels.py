"""Tier 2 (CPU): every Triton kernel under Triton's interpreter, fp32, against its PyTorch reference.

The interpreter is switched on before Triton is imported (on a machine without a GPU); on a GPU the same
tests compile the kernels for real.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from smalti.moe import MoE, reference  # noqa: E402
from smalti.moe import triton_kernels as tk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed(tokens=37, k=2, experts=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, k), generator=gen)
    ids[ids == 3] = 1  # leave expert 3 empty
    return ids.to(DEVICE)


def test_sort_matches_reference():
    ids = routed()
    for got, want in zip(tk.sort_by_expert(ids, 5), reference.sort_by_expert(ids, 5)):
        assert torch.equal(got.cpu(), want.cpu())


def test_gather_and_weighted_scatter():
    ids = routed()
    perm, _, _ = reference.sort_by_expert(ids, 5)
    x = torch.randn(37, 40, device=DEVICE)
    assert torch.equal(tk.gather_rows(x, perm, 2), reference.gather_rows(x, perm, 2))
    ys, w = torch.randn(74, 40, device=DEVICE), torch.rand(37, 2, device=DEVICE)
    torch.testing.assert_close(tk.scatter_rows(ys, perm, w, 2), reference.scatter_rows(ys, perm, w, 2))


@pytest.mark.parametrize(("d", "f"), [(40, 24), (64, 48)])
def test_grouped_gemm_forward_and_both_backward(d, f):
    ids = routed()
    perm, _, offsets = reference.sort_by_expert(ids, 5)
    x = torch.randn(37, d, device=DEVICE)
    a = reference.gather_rows(x, perm, 2)
    w = torch.randn(5, d, f, device=DEVICE)
    torch.testing.assert_close(tk.grouped_mm(a, w, offsets), reference.grouped_mm(a, w, offsets), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tk.gather_mm(x, w, perm, offsets, 2), reference.gather_mm(x, w, perm, offsets, 2),
                               rtol=1e-5, atol=1e-4)
    dc = torch.randn(74, f, device=DEVICE)
    torch.testing.assert_close(tk.grouped_mm_wgrad(a, dc, offsets), reference.grouped_mm_wgrad(a, dc, offsets),
                               rtol=1e-5, atol=1e-4)
    wt = w.transpose(1, 2).contiguous()
    torch.testing.assert_close(tk.grouped_mm(dc, wt, offsets), reference.grouped_mm(dc, wt, offsets),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_fused_glu_forward_backward(activation):
    g = torch.randn(50, 24, device=DEVICE, requires_grad=True)
    u = torch.randn(50, 24, device=DEVICE, requires_grad=True)
    out = reference.glu(g, u, activation)
    dout = torch.randn_like(out)
    dg, du = torch.autograd.grad(out, (g, u), dout)
    torch.testing.assert_close(tk.glu(g.detach(), u.detach(), activation), out.detach(), rtol=1e-5, atol=1e-6)
    tdg, tdu = tk.glu_backward(g.detach(), u.detach(), dout, activation)
    torch.testing.assert_close(tdg, dg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tdu, du, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
def test_layer_triton_backend_matches_torch_backend(mlp_type):
    kw = dict(hidden_size=40, ffn_hidden_size=24, num_experts=4, top_k=2, mlp_type=mlp_type,
              activation="silu" if mlp_type == "glu" else "gelu", device=DEVICE)
    torch.manual_seed(0)
    ref = MoE(backend="torch", **kw)
    torch.manual_seed(0)
    tri = MoE(backend="triton", **kw)
    x = torch.randn(29, 40, device=DEVICE)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, lr = ref(xr)
    yt, lt = tri(xt)
    torch.testing.assert_close(yt, yr, rtol=1e-5, atol=1e-5)
    (yr.square().sum() + lr).backward()
    (yt.square().sum() + lt).backward()
    torch.testing.assert_close(xt.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for a, b in zip(tri.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
