"""smalti.core.cpu_gemm: OpenBLAS products exact to fp32 rounding, the fallbacks, the policy and its switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from smalti.core import cpu_gemm
from smalti.core.errors import ConfigError

needs_openblas = pytest.mark.skipif(cpu_gemm._find_openblas() is None, reason="numpy's BLAS is not OpenBLAS")


@pytest.fixture
def sgemm_calls(monkeypatch):
    """Counts the products that went through OpenBLAS; restores the process's backend afterwards."""
    calls = []
    real = cpu_gemm._openblas_sgemm

    def spy(out, a, b, beta):
        calls.append((tuple(a.shape), tuple(b.shape), beta))
        real(out, a, b, beta)

    monkeypatch.setattr(cpu_gemm, "_openblas_sgemm", spy)
    monkeypatch.setattr(cpu_gemm, "_backend", cpu_gemm._backend)
    return calls


@pytest.fixture
def openblas(sgemm_calls, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_torch_blas_is_mkl", lambda: True)
    assert cpu_gemm.configure_cpu_gemm("openblas", "cpu", cpu_vendor="AuthenticAMD").startswith(
        "trainer.cpu_gemm=openblas")
    return sgemm_calls


def _operand(rows: int, cols: int, transposed: bool) -> torch.Tensor:
    return torch.randn(cols, rows).t() if transposed else torch.randn(rows, cols)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    assert ((got - want).abs().max() / want.abs().max()).item() < rel


@needs_openblas
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul_into_matches_torch_mm(openblas, trans_a, trans_b, accumulate):
    m, k, n = 160, 384, 600  # 2*m*k*n = 74M flops, above MIN_FLOPS
    assert 2 * m * k * n >= cpu_gemm.MIN_FLOPS
    a, b = _operand(m, k, trans_a), _operand(k, n, trans_b)
    start = torch.randn(m, n)
    out = start.clone()
    assert cpu_gemm.matmul_into(out, a, b, accumulate=accumulate) is out
    _close(out, torch.addmm(start, a, b) if accumulate else torch.mm(a, b))
    assert openblas == [((m, k), (k, n), 1.0 if accumulate else 0.0)]


@needs_openblas
def test_matmul_into_row_slices_with_leading_dimension(openblas):
    big = torch.randn(300, 1024)
    a, b = big[:200, 100:612], torch.randn(900, 512)[::1, :].t()[:, 50:850]  # lda 1024, b transposed with ldb 512
    out = torch.zeros(220, 800)[10:210]
    cpu_gemm.matmul_into(out, a, b)
    _close(out, a @ b)
    assert len(openblas) == 1


@needs_openblas
@pytest.mark.parametrize("case", ["small", "float64", "strided", "grad", "overlap"])
def test_matmul_into_falls_back_to_torch(openblas, case):
    m, k, n = 160, 384, 600
    a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    if case == "small":
        a, b, out = a[:8], b, out[:8]
    elif case == "float64":
        a, b, out = a.double(), b.double(), out.double()
    elif case == "strided":
        a = torch.randn(m, 2 * k)[:, ::2]
    elif case == "grad":
        a.requires_grad_()
        with pytest.raises(RuntimeError, match="out="):
            cpu_gemm.matmul_into(out, a, b)
        assert openblas == []
        return
    elif case == "overlap":
        buf = torch.randn(m * n + m * k)
        a, out = buf[:m * k].view(m, k), buf[m * k - 1000:m * k - 1000 + m * n].view(m, n)
        want = a @ b
    if case != "overlap":
        want = a @ b
    cpu_gemm.matmul_into(out, a, b)
    assert openblas == []
    if case != "overlap":  # torch.mm refuses overlapping out= or gives its own result; no BLAS call either way
        torch.testing.assert_close(out, want)


def test_torch_backend_never_calls_openblas(sgemm_calls):
    cpu_gemm.configure_cpu_gemm("torch", "cpu")
    a, b, out = torch.randn(160, 384), torch.randn(384, 600), torch.ones(160, 600)
    cpu_gemm.matmul_into(out, a, b, accumulate=True)
    torch.testing.assert_close(out, torch.addmm(torch.ones(160, 600), a, b))
    assert sgemm_calls == []


# --- linear -----------------------------------------------------------------------------------------------------


@needs_openblas
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_matches_f_linear_with_grads(openblas, with_bias):
    x = torch.randn(3, 100, 256, requires_grad=True)
    w = torch.randn(768, 256, requires_grad=True)
    b = torch.randn(768, requires_grad=True) if with_bias else None
    y = cpu_gemm.linear(x, w, b)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)
    y_ref = F.linear(x, w, b)
    grads_ref = torch.autograd.grad(y_ref, [t for t in (x, w, b) if t is not None], dy)
    _close(y, y_ref)
    for got, want in zip(grads, grads_ref):
        _close(got, want)
    assert len(openblas) == 3  # forward, grad input, grad weight


@needs_openblas
def test_linear_skips_grads_not_needed(openblas):
    x = torch.randn(300, 256)
    w = torch.randn(768, 256, requires_grad=True)
    cpu_gemm.linear(x, w).square().sum().backward()
    assert [shape for shape, _, _ in openblas] == [(300, 256), (768, 300)]  # forward, grad weight; no grad input
    openblas.clear()
    x.requires_grad_()
    w.requires_grad_(False)
    cpu_gemm.linear(x, w).square().sum().backward()
    assert [shape for shape, _, _ in openblas] == [(300, 256), (300, 768)]  # forward, grad input; no grad weight


@needs_openblas
def test_linear_falls_back_under_autocast_and_for_small_products(openblas):
    x, w = torch.randn(300, 256), torch.randn(768, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_gemm.linear(x, w).dtype == torch.bfloat16
    torch.testing.assert_close(cpu_gemm.linear(x[:4], w), F.linear(x[:4], w), rtol=0, atol=0)
    assert openblas == []


@needs_openblas
def test_linear_module_keeps_nn_linear_parameters_and_init(openblas):
    torch.manual_seed(0)
    ours = cpu_gemm.Linear(256, 768)
    torch.manual_seed(0)
    theirs = nn.Linear(256, 768)
    assert isinstance(ours, nn.Linear)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    torch.testing.assert_close(ours.state_dict(), theirs.state_dict(), rtol=0, atol=0)
    x = torch.randn(300, 256)
    _close(ours(x), theirs(x))
    assert len(openblas) == 1


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(cpu_gemm.Linear(256, 512), nn.GELU(), cpu_gemm.Linear(512, 256))


@needs_openblas
def test_linear_under_non_reentrant_checkpoint(openblas):
    model, x = _mlp(), torch.randn(300, 256, requires_grad=True)
    checkpoint(model, x, use_reentrant=False).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    cpu_gemm.configure_cpu_gemm("torch", "cpu")
    model(x).square().sum().backward()
    for got, p in zip(grads, model.parameters()):
        _close(got, p.grad)
    assert len(openblas) == 2 + 2 + 2 * 2  # forward, recomputed forward, grad input and grad weight of each


@needs_openblas
def test_one_compiled_step_keeps_the_custom_op(openblas):
    torch._dynamo.reset()
    model, x = _mlp(), torch.randn(300, 256, requires_grad=True)
    compiled = torch.compile(model)
    compiled(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert len(openblas) == 6  # 2 forward, 2 grad weight, 2 grad input: none were traced into aten.mm
    model.zero_grad()
    cpu_gemm.configure_cpu_gemm("torch", "cpu")
    model(x).square().sum().backward()
    for got, p in zip(grads, model.parameters()):
        _close(got, p.grad)
    torch._dynamo.reset()


# --- policy -----------------------------------------------------------------------------------------------------


@needs_openblas
def test_auto_picks_openblas_on_amd_with_mkl(sgemm_calls, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_torch_blas_is_mkl", lambda: True)
    message = cpu_gemm.configure_cpu_gemm("auto", "cpu", cpu_vendor="AuthenticAMD")
    assert cpu_gemm.backend() == "openblas" and "OpenBLAS" in message


@needs_openblas
def test_auto_keeps_torch_on_intel_without_mkl_and_off_cpu(sgemm_calls, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_torch_blas_is_mkl", lambda: True)
    assert "Intel" in cpu_gemm.configure_cpu_gemm("auto", "cpu", cpu_vendor="GenuineIntel")
    assert cpu_gemm.backend() == "torch"
    assert "cuda" in cpu_gemm.configure_cpu_gemm("auto", "cuda", cpu_vendor="AuthenticAMD")
    assert cpu_gemm.backend() == "torch"
    monkeypatch.setattr(cpu_gemm, "_torch_blas_is_mkl", lambda: False)
    assert "not MKL" in cpu_gemm.configure_cpu_gemm("auto", "cpu", cpu_vendor="AuthenticAMD")
    assert cpu_gemm.backend() == "torch"


def test_bad_setting_and_impossible_openblas_are_config_errors(sgemm_calls, monkeypatch):
    with pytest.raises(ConfigError, match=r"trainer.cpu_gemm='mkl'.*auto, openblas, torch"):
        cpu_gemm.configure_cpu_gemm("mkl", "cpu")
    monkeypatch.setattr(cpu_gemm, "_openblas", None)  # numpy's BLAS not OpenBLAS
    with pytest.raises(ConfigError, match=r"trainer.cpu_gemm=openblas cannot apply: numpy's BLAS"):
        cpu_gemm.configure_cpu_gemm("openblas", "cpu", cpu_vendor="AuthenticAMD")
    assert cpu_gemm.configure_cpu_gemm("auto", "cpu", cpu_vendor="AuthenticAMD").startswith("trainer.cpu_gemm=auto")
    assert cpu_gemm.backend() == "torch"


@needs_openblas
def test_backend_resolves_auto_when_not_configured(sgemm_calls, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_backend", None)
    monkeypatch.setattr(cpu_gemm, "_cpu_vendor", lambda: "GenuineIntel")
    assert cpu_gemm.backend() == "torch"
    monkeypatch.setattr(cpu_gemm, "_backend", None)
    monkeypatch.setattr(cpu_gemm, "_cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(cpu_gemm, "_torch_blas_is_mkl", lambda: True)
    assert cpu_gemm.backend() == "openblas"


@needs_openblas
def test_openblas_runs_on_one_thread_whatever_torchs_count(openblas):
    """OpenBLAS's threaded sgemm splits some products differently by thread count: one thread keeps smalti's
    default-mode losses the same bit for bit with 1 or 2 intra-op threads."""
    from threadpoolctl import threadpool_info

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_gemm.configure_cpu_gemm("openblas", "cpu", cpu_vendor="AuthenticAMD")
        info = [i for i in threadpool_info() if i["filepath"] == cpu_gemm._openblas.filepath]
        assert info[0]["num_threads"] == 1
    finally:
        torch.set_num_threads(before)
        cpu_gemm.configure_cpu_gemm("openblas", "cpu", cpu_vendor="AuthenticAMD")


# --- the Trainer and the config key -----------------------------------------------------------------------------


def _trainer_with(tmp_path, **kwargs):
    from smalti.core.examples.model import MLPRegressor
    from smalti.core.trainer import Trainer

    batches = [(torch.zeros(2, 4), torch.zeros(2, 2))]
    return Trainer(MLPRegressor(4, 8, 2, 1), batches, "1ba", eval_interval=None, loggers=[], progress_bar=False,
                   output_dir=tmp_path, **kwargs)


def test_trainer_applies_cpu_gemm(sgemm_calls, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_backend", "openblas")
    _trainer_with(tmp_path, cpu_gemm="torch").close()
    assert cpu_gemm.backend() == "torch"
    with pytest.raises(ConfigError, match="trainer.cpu_gemm='fast'"):
        _trainer_with(tmp_path, cpu_gemm="fast")


@needs_openblas
def test_config_key_reaches_the_trainer(sgemm_calls, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    import smalti.core.cli.train  # noqa: F401 - registers the config schema
    from smalti.core.config.build import build_trainer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cpu_gemm, "_torch_blas_is_mkl", lambda: True)
    monkeypatch.setattr(cpu_gemm, "_cpu_vendor", lambda: "AuthenticAMD")
    for setting, resolved in (("openblas", "openblas"), ("torch", "torch"), ("auto", "openblas")):
        with initialize_config_module(version_base="1.3", config_module="smalti.core.conf"):
            cfg = compose("train", overrides=["model=tiny_lm", "data=synthetic", "callbacks=[]", "logger=[]",
                                              "trainer.eval_interval=null", f"trainer.cpu_gemm={setting}"])
        build_trainer(cfg).close()
        assert cpu_gemm.backend() == resolved
