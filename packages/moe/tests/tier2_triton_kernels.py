"""Tier 2: every Triton kernel under Triton's CPU interpreter, in fp32 against its PyTorch reference.

Not collected on its own (the name does not start with ``test_``): ``test_triton_interpreter.py`` runs this
file in a child pytest with ``TRITON_INTERPRET=1`` set before anything imports Triton, so the setting
never leaks into the other tests of the process. Run it directly with::

    TRITON_INTERPRET=1 .venv/bin/python -m pytest packages/moe/tests/tier2_triton_kernels.py -q
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("tier 2 runs under TRITON_INTERPRET=1 (see test_triton_interpreter.py)", allow_module_level=True)

triton = pytest.importorskip("triton")

from smalti.moe import MoE, ops, reference  # noqa: E402
from smalti.moe import triton_kernels as tk  # noqa: E402

# fp32 GEMMs accumulate in a different order than torch's: a few ulps of the sums.
TOL = dict(rtol=1e-5, atol=1e-5)


def routed(tokens: int, k: int, experts: int, seed: int = 0, empty: int | None = None) -> torch.Tensor:
    """Top-k style expert ids ``[tokens, k]`` (distinct per token); expert ``empty`` gets no tokens."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(experts) if e != empty])
    return torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(tokens)])


def test_interpreter_is_on():
    assert tk.INTERPRET  # otherwise the kernels below would try to compile for a GPU


@pytest.mark.parametrize(("tokens", "k", "experts"), [(1, 1, 1), (37, 2, 5), (150, 2, 7), (70, 4, 40), (9, 4, 4)])
def test_sort_by_expert_matches_reference(tokens, k, experts):
    ids = routed(tokens, k, experts, empty=3 if experts > 4 else None)
    got = tk.sort_by_expert(ids, experts)
    want = reference.sort_by_expert(ids, experts)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_gather_and_weighted_scatter():
    ids = routed(37, 2, 5, empty=3)
    perm, _, _ = reference.sort_by_expert(ids, 5)
    x = torch.randn(37, 70)
    assert torch.equal(tk.gather_rows(x, perm, 2), reference.gather_rows(x, perm, 2))
    ys, w = torch.randn(74, 70), torch.rand(37, 2)
    torch.testing.assert_close(tk.scatter_rows(ys, perm, w, 2), reference.scatter_rows(ys, perm, w, 2), **TOL)
    torch.testing.assert_close(tk.scatter_rows(ys, perm, None, 2), reference.scatter_rows(ys, perm, None, 2), **TOL)


@pytest.mark.parametrize(("d", "f"), [(40, 24), (64, 80)])
def test_grouped_gemms_forward_and_backward_kernels(d, f):
    ids = routed(37, 2, 5, empty=3)
    perm, _, offsets = reference.sort_by_expert(ids, 5)
    x = torch.randn(37, d)
    a = reference.gather_rows(x, perm, 2)
    w = torch.randn(5, d, f)
    dc = torch.randn(74, f)
    wt = w.transpose(1, 2)  # strided view: the input-gradient GEMM reads it without a copy
    pairs = [
        (tk.grouped_mm(a, w, offsets), reference.grouped_mm(a, w, offsets)),
        (tk.grouped_mm(dc, wt, offsets), reference.grouped_mm(dc, wt, offsets)),
        (tk.gather_mm(x, w, perm, offsets, 2), reference.gather_mm(x, w, perm, offsets, 2)),
        (tk.mm_scatter(dc, wt, perm, offsets), reference.mm_scatter(dc, wt, perm, offsets)),
        (tk.grouped_mm_wgrad(a, dc, offsets), reference.grouped_mm_wgrad(a, dc, offsets)),
        (tk.grouped_mm_wgrad(x, dc, offsets, a_index=perm // 2), reference.grouped_mm_wgrad(a, dc, offsets)),
        (tk.grouped_mm_wgrad(a, dc, offsets, dc_index=perm), reference.grouped_mm_wgrad(a, dc, offsets, dc_index=perm)),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want, **TOL)
    assert tk.grouped_mm_wgrad(a, dc, offsets)[3].abs().sum() == 0  # the empty expert's gradient is zero


def test_bf16_gemm_under_interpreter_is_not_garbage():
    # The interpreter's bf16 tl.dot multiplies bit patterns; the kernels upcast first. bf16 output: 2**-8 relative.
    ids = routed(37, 2, 5)
    perm, _, offsets = reference.sort_by_expert(ids, 5)
    x, w = torch.randn(37, 48).bfloat16(), torch.randn(5, 48, 32).bfloat16()
    want = reference.gather_mm(x.float(), w.float(), perm, offsets, 2)
    torch.testing.assert_close(tk.gather_mm(x, w, perm, offsets, 2).float(), want, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_fused_glu_forward_backward_on_column_slices(activation):
    h = torch.randn(50, 2 * 40)
    gate, up = h.split(40, dim=-1)  # views with row stride 80, as the layer passes them
    dout = torch.randn(50, 40)
    torch.testing.assert_close(tk.glu(gate, up, activation), reference.glu(gate, up, activation), **TOL)
    for got, want in zip(tk.glu_backward(gate, up, dout, activation), reference.glu_backward(gate, up, dout, activation)):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("op", ["gather_mm", "mm_scatter", "grouped_mm", "gather_rows", "scatter_rows"])
def test_autograd_ops_triton_equal_torch(op):
    ids = routed(29, 2, 4, empty=2)
    perm, _, offsets = reference.sort_by_expert(ids, 4)
    x, w, ws = torch.randn(29, 40), torch.randn(4, 40, 24), torch.rand(29, 2)
    rows = torch.randn(58, 40)
    args = {
        "gather_mm": lambda be, t: ops.gather_mm(t[0], t[1], perm, offsets, 2, be),
        "mm_scatter": lambda be, t: ops.mm_scatter(t[2], t[1], perm, offsets, be),
        "grouped_mm": lambda be, t: ops.grouped_mm(t[2], t[1], offsets, be),
        "gather_rows": lambda be, t: ops.gather_rows(t[0], perm, 2, be),
        "scatter_rows": lambda be, t: ops.scatter_rows(t[2], perm, t[3], 2, be),
    }[op]
    results = {}
    for be in ("torch", "triton"):
        leaves = [t.clone().requires_grad_() for t in (x, w, rows, ws)]
        out = args(be, leaves)
        out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1]))
        results[be] = (out.detach(), [t.grad for t in leaves])
    torch.testing.assert_close(results["triton"][0], results["torch"][0], **TOL)
    for g_tri, g_ref in zip(results["triton"][1], results["torch"][1]):
        assert (g_tri is None) == (g_ref is None)
        if g_ref is not None:
            torch.testing.assert_close(g_tri, g_ref, **TOL)


@pytest.mark.parametrize(("mlp_type", "tokens", "k", "hidden"), [("mlp", 29, 2, 40), ("glu", 29, 2, 40),
                                                                  ("glu", 1, 2, 24), ("mlp", 9, 4, 24)])
def test_layer_triton_backend_matches_torch_backend(mlp_type, tokens, k, hidden):
    kw = dict(hidden_size=hidden, ffn_hidden_size=24, num_experts=4, top_k=k, mlp_type=mlp_type,
              activation="silu" if mlp_type == "glu" else "gelu", num_shared_experts=1, zloss_weight=1e-3)
    torch.manual_seed(0)
    ref = MoE(backend="torch", **kw)
    torch.manual_seed(0)
    tri = MoE(backend="triton", **kw)
    x = torch.randn(tokens, hidden)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, lr = ref(xr)
    yt, lt = tri(xt)
    torch.testing.assert_close(yt, yr, **TOL)
    (yr.square().sum() + lr).backward()
    (yt.square().sum() + lt).backward()
    torch.testing.assert_close(xt.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(tri.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_triton_layer_refuses_float64_with_the_fix():
    from smalti.moe import MoEError

    layer = MoE(hidden_size=16, ffn_hidden_size=16, num_experts=2, top_k=1, backend="triton", dtype=torch.float64)
    with pytest.raises(MoEError, match="float64.*backend='torch'"):
        layer(torch.randn(3, 16, dtype=torch.float64))
