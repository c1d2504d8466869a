"""Tier 1 (CPU): the PyTorch reference kernels against naive row loops, and every autograd op by gradcheck."""

import pytest
import torch

from smalti.moe import ops, reference


def routed(tokens: int, k: int, experts: int, seed: int = 0, empty: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(experts) if e != empty])
    return torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(tokens)])


def test_sort_is_stable_with_counts_and_offsets():
    ids = routed(23, 3, 6, empty=4)
    perm, counts, offsets = reference.sort_by_expert(ids, 6)
    flat = ids.reshape(-1).tolist()
    naive = [n for e in range(6) for n in range(len(flat)) if flat[n] == e]  # by expert, then entry order
    assert perm.tolist() == naive
    assert counts.tolist() == [flat.count(e) for e in range(6)] and counts[4] == 0
    assert offsets.tolist() == torch.cumsum(counts, 0).tolist()


def test_kernels_match_row_loops():
    k, experts = 2, 4
    ids = routed(13, k, experts, empty=1)
    perm, _, offsets = reference.sort_by_expert(ids, experts)
    expert_of = ids.reshape(-1)[perm]  # expert of each sorted row
    x, w = torch.randn(13, 7, dtype=torch.float64), torch.randn(experts, 7, 5, dtype=torch.float64)
    weights = torch.rand(13, k, dtype=torch.float64)

    xs = reference.gather_rows(x, perm, k)
    for i in range(perm.numel()):
        assert torch.equal(xs[i], x[perm[i] // k])
    ys = reference.gather_mm(x, w, perm, offsets, k)
    for i in range(perm.numel()):
        torch.testing.assert_close(ys[i], x[perm[i] // k] @ w[expert_of[i]])
    torch.testing.assert_close(reference.grouped_mm(xs, w, offsets), ys)
    z = reference.mm_scatter(xs, w, perm, offsets)
    for i in range(perm.numel()):
        torch.testing.assert_close(z[perm[i]], xs[i] @ w[expert_of[i]])
    y = reference.scatter_rows(ys, perm, weights, k)
    for t in range(13):
        want = sum(weights[t, j] * ys[(perm == t * k + j).nonzero()[0, 0]] for j in range(k))
        torch.testing.assert_close(y[t], want)
    torch.testing.assert_close(ops.combine(z, weights), y)
    dc = torch.randn(perm.numel(), 5, dtype=torch.float64)
    dw = reference.grouped_mm_wgrad(xs, dc, offsets)
    for e in range(experts):
        rows = (expert_of == e).nonzero()[:, 0]
        torch.testing.assert_close(dw[e], xs[rows].t() @ dc[rows])
    assert dw[1].abs().sum() == 0


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_exact", "relu"])
def test_glu_backward_matches_autograd(activation):
    g = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    u = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(6, 5, dtype=torch.float64)
    want = torch.autograd.grad(reference.glu(g, u, activation), (g, u), dout)
    got = reference.glu_backward(g.detach(), u.detach(), dout, activation)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_exact", "relu"])
def test_packed_glu_backward_matches_autograd(activation):
    h = torch.randn(7, 10, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(7, 5, dtype=torch.float64)
    out = reference.glu(h[:, :5], h[:, 5:], activation)
    (want,) = torch.autograd.grad(out, h, dout)
    dh, recomputed = reference.glu_packed_backward(h.detach(), dout, activation)
    torch.testing.assert_close(dh, want)
    torch.testing.assert_close(recomputed, out.detach())
    torch.testing.assert_close(reference.glu_packed(h.detach(), activation), out.detach())
    assert reference.glu_packed_backward(h.detach(), dout, activation, input_grad=False)[0] is None


@pytest.mark.parametrize("k", [1, 2, 3])
def test_autograd_ops_gradcheck_float64(k):
    experts = 4
    ids = routed(5, k, experts, empty=2)
    perm, _, offsets = reference.sort_by_expert(ids, experts)
    n = perm.numel()

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    x, w, rows, weights = leaf(5, 6), leaf(experts, 6, 3), leaf(n, 6), leaf(5, k)
    checks = {
        "gather_mm": (lambda x, w: ops.gather_mm(x, w, perm, offsets, k, "torch"), (x, w)),
        "mm_scatter": (lambda r, w: ops.mm_scatter(r, w, perm, offsets, "torch"), (rows, w)),
        "grouped_mm": (lambda r, w: ops.grouped_mm(r, w, offsets, "torch"), (rows, w)),
        "gather_rows": (lambda x: ops.gather_rows(x, perm, k, "torch"), (x,)),
        "scatter_rows": (lambda r, ws: ops.scatter_rows(r, perm, ws, k, "torch"), (rows, weights)),
        "combine": (lambda r, ws: ops.combine(r, ws), (rows, weights)),
        "glu": (lambda r: ops.glu(r[:, :3], r[:, 3:], "silu", "torch"), (rows,)),
        "glu_mm_scatter": (lambda r, w: ops.glu_mm_scatter(r, w, perm, offsets, "silu", "torch"),
                           (rows, leaf(experts, 3, 4))),
    }
    for name, (fn, inputs) in checks.items():
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6), name
