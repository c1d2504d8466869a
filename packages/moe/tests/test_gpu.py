"""Tier 3 (GPU only): the Triton kernels compiled for real, in bf16 against the fp32 reference, plus determinism.

Tolerances: a bf16 output is its fp32 value rounded to 8 mantissa bits (relative error <= 2**-9 ~ 2e-3
per element); inputs are rounded to bf16 *before* the fp32 reference runs, so the only other difference
is the fp32 accumulation order. Comparing whole tensors by relative Frobenius error, 5e-3 holds for one
kernel. Through the layer (two GEMMs, activation, combine, each rounding to bf16) errors compound: 3e-2
forward and backward. fp32 kernels run tl.dot in IEEE mode (no TF32), so they match the reference to 1e-5.
"""

import pytest
import torch

from smalti.moe import MoE, reference

pytestmark = pytest.mark.gpu

DEV = "cuda"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def routed(tokens: int, k: int, experts: int, empty: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    pool = torch.tensor([e for e in range(experts) if e != empty])
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(tokens)])
    return ids.to(DEV)


@pytest.fixture(scope="module")
def tk():
    from smalti.moe import triton_kernels

    assert not triton_kernels.INTERPRET, "tier 3 compiles the kernels; unset TRITON_INTERPRET"
    return triton_kernels


@pytest.mark.parametrize(("tokens", "k", "experts"), [(1, 1, 1), (4096, 2, 8), (3000, 8, 64)])
def test_sort_exact(tk, tokens, k, experts):
    ids = routed(tokens, k, experts, empty=3 if experts > 3 else -1)
    for got, want in zip(tk.sort_by_expert(ids, experts), reference.sort_by_expert(ids, experts)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("d", "f"), [(256, 512), (600, 344)])
def test_grouped_gemms(tk, dtype, d, f):
    ids = routed(1000, 2, 8)
    perm, _, offsets = reference.sort_by_expert(ids, 8)
    x = torch.randn(1000, d, device=DEV).to(dtype)
    w = (torch.randn(8, d, f, device=DEV) / d**0.5).to(dtype)
    dc = torch.randn(2000, f, device=DEV).to(dtype)
    xs = reference.gather_rows(x, perm, 2)
    f32 = lambda t: t.float()  # noqa: E731
    cases = {
        "gather_mm": (tk.gather_mm(x, w, perm, offsets, 2), reference.gather_mm(f32(x), f32(w), perm, offsets, 2)),
        "grouped_mm_t": (tk.grouped_mm(dc, w.transpose(1, 2), offsets),
                         reference.grouped_mm(f32(dc), f32(w).transpose(1, 2), offsets)),
        "mm_scatter": (tk.mm_scatter(dc, w.transpose(1, 2), perm, offsets),
                       reference.mm_scatter(f32(dc), f32(w).transpose(1, 2), perm, offsets)),
        "wgrad": (tk.grouped_mm_wgrad(x, dc, offsets, a_index=perm // 2),
                  reference.grouped_mm_wgrad(f32(xs), f32(dc), offsets)),
    }
    limit = 5e-3 if dtype == torch.bfloat16 else 1e-5
    for name, (got, want) in cases.items():
        assert got.dtype == dtype
        assert rel_err(got, want) < limit, name


@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
def test_layer_bf16_forward_backward_against_fp32_reference(mlp_type):
    kw = dict(hidden_size=512, ffn_hidden_size=768, num_experts=8, top_k=2, mlp_type=mlp_type,
              activation="silu" if mlp_type == "glu" else "gelu", device=DEV)
    torch.manual_seed(0)
    tri = MoE(backend="triton", dtype=torch.bfloat16, **kw)
    ref = MoE(backend="torch", **kw)
    ref.load_state_dict({k: v.float() for k, v in tri.state_dict().items()})  # the same (bf16-exact) weights
    x = torch.randn(2048, 512, device=DEV).bfloat16()
    xt, xr = x.clone().requires_grad_(), x.float().requires_grad_()
    yt, _ = tri(xt)
    yr, _ = ref(xr)
    assert rel_err(yt, yr) < 3e-2
    gy = torch.randn_like(yr)
    yt.backward(gy.bfloat16())
    yr.backward(gy)
    assert rel_err(xt.grad, xr.grad) < 3e-2
    for name in ("w1", "w2"):
        assert rel_err(getattr(tri, name).grad, getattr(ref, name).grad) < 3e-2, name


def test_layer_fp32_triton_equals_torch():
    kw = dict(hidden_size=200, ffn_hidden_size=136, num_experts=6, top_k=3, mlp_type="glu", activation="silu",
              device=DEV)
    torch.manual_seed(0)
    tri = MoE(backend="triton", **kw)
    ref = MoE(backend="torch", **kw)
    ref.load_state_dict(tri.state_dict())
    x = torch.randn(333, 200, device=DEV)
    xt, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    (yt, _), (yr, _) = tri(xt), ref(xr)
    torch.testing.assert_close(yt, yr, rtol=1e-5, atol=1e-5)
    yt.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(xt.grad, xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tri.w1.grad, ref.w1.grad, rtol=1e-4, atol=1e-4)


def test_triton_is_deterministic():
    torch.manual_seed(0)
    layer = MoE(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2, mlp_type="glu", activation="silu",
                backend="triton", device=DEV, dtype=torch.bfloat16)
    x = torch.randn(4096, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    runs = []
    for _ in range(2):
        x.grad = None
        layer.zero_grad()
        y, _ = layer(x)
        y.float().square().sum().backward()
        runs.append([y.detach().clone(), x.grad.clone(), layer.w1.grad.clone(), layer.w2.grad.clone(),
                     layer.router.gate.weight.grad.clone()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
