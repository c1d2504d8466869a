"""smalti-llm gives smalti-moe's CPU expert GEMMs smalti-core's CPU product when core's backend is OpenBLAS."""

from __future__ import annotations

import pytest
import torch

from smalti.core import cpu_gemm
from smalti.llm.model.ffn import make_ffn
from smalti.moe import ops


@pytest.fixture
def spy(monkeypatch):
    """``cpu_gemm.matmul_into`` replaced by a counting torch product of its signature (the tests fake the backend,
    so the real one is not called); the MoE product reset around the test."""
    calls = []

    def counting(out, a, b, *, accumulate=False):
        calls.append(tuple(out.shape))
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)

    monkeypatch.setattr(cpu_gemm, "matmul_into", counting)
    previous = ops.set_cpu_matmul(None)
    yield calls
    ops.set_cpu_matmul(previous)


def _step(ffn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ffn.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y, _aux = ffn(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return (y.detach(), x.grad, *(p.grad.clone() for p in ffn.parameters()))


def _moe() -> torch.nn.Module:
    torch.manual_seed(0)
    return make_ffn("moe", 32, 24, "silu", False, {"num_experts": 4, "top_k": 2})


def test_openblas_backend_installs_matmul_into_for_every_expert_product(spy, monkeypatch):
    x = torch.randn(2, 20, 32)
    monkeypatch.setattr(cpu_gemm, "backend", lambda: "torch")
    expected = _step(_moe(), x)
    assert ops.get_cpu_matmul() is None and not spy
    monkeypatch.setattr(cpu_gemm, "backend", lambda: "openblas")
    ffn = _moe()
    assert ops.get_cpu_matmul() is cpu_gemm.matmul_into
    got = _step(ffn, x)
    assert len(spy) == 6 * 4  # 4 experts: 2 forward, 2 input-gradient and 2 weight-gradient products each
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_torch_backend_takes_it_out_again_and_leaves_another_product_alone(spy, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "backend", lambda: "openblas")
    _moe()
    assert ops.get_cpu_matmul() is cpu_gemm.matmul_into
    monkeypatch.setattr(cpu_gemm, "backend", lambda: "torch")
    _step(_moe(), torch.randn(2, 20, 32))
    assert ops.get_cpu_matmul() is None and not spy

    def mine(out, a, b, *, accumulate=False):
        return torch.mm(a, b, out=out)

    ops.set_cpu_matmul(mine)
    _moe()
    assert ops.get_cpu_matmul() is mine
    monkeypatch.setattr(cpu_gemm, "backend", lambda: "openblas")
    _moe()
    assert ops.get_cpu_matmul() is mine
