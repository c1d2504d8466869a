"""The dense model's products go through smalti.core.cpu_gemm's OpenBLAS backend, and not when it is off."""

from __future__ import annotations

import pytest
import torch

from smalti.core import cpu_gemm
from smalti.llm import LLM

# 256 tokens: the projections (d_model 256, ffn 1024, head 512) are above cpu_gemm.MIN_FLOPS
SHAPE = dict(d_model=256, n_heads=4, n_layers=1, vocab_size=512, max_seq_len=128, ffn_type="glu")


@pytest.fixture
def sgemm_calls(monkeypatch):
    if cpu_gemm._find_openblas() is None:
        pytest.skip("numpy's BLAS is not OpenBLAS")
    calls = []
    real = cpu_gemm._openblas_sgemm

    def spy(out, a, b, beta):
        calls.append(tuple(out.shape))
        real(out, a, b, beta)

    monkeypatch.setattr(cpu_gemm, "_openblas_sgemm", spy)
    monkeypatch.setattr(cpu_gemm, "_backend", cpu_gemm._backend)
    monkeypatch.setattr(cpu_gemm, "_torch_blas_is_mkl", lambda: True)
    return calls


def _step(fused_loss: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = LLM(**SHAPE, fused_loss=fused_loss).train()
    batch = {"input_ids": torch.randint(0, 512, (2, 128))}
    loss = model.loss(model(batch), batch)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("fused_loss", [False, True])
def test_a_model_step_uses_openblas_only_when_switched_on(sgemm_calls, fused_loss):
    cpu_gemm.configure_cpu_gemm("openblas", "cpu", cpu_vendor="AuthenticAMD")
    loss, grads = _step(fused_loss)
    products = set(sgemm_calls)
    # wqkv (3*256 out), out_proj, gate/up (1024), down: forward, grad input and grad weight shapes
    assert {(256, 768), (256, 1024), (1024, 256), (768, 256), (256, 256)} <= products
    if not fused_loss:
        assert (256, 512) in products  # the non-fused head's logits
    sgemm_calls.clear()
    cpu_gemm.configure_cpu_gemm("torch", "cpu")
    loss_torch, grads_torch = _step(fused_loss)
    assert sgemm_calls == []
    torch.testing.assert_close(loss, loss_torch, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_torch):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


@pytest.mark.world_size(2, timeout=600)  # two torchrun ranks importing torch: minutes on a loaded machine
def test_fsdp_two_ranks_on_openblas_match_one_rank(sgemm_calls, monkeypatch):
    import functools

    import torch.distributed as dist

    from smalti.core import Callback, Trainer
    from smalti.core.data import build_dataloader
    from smalti.core.parallelism import FSDP
    from smalti.llm.data.synthetic import MarkovTokens

    class Losses(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_batch_end(self, state, logger) -> None:
            self.values.append(float(state.batch_loss))

    monkeypatch.setattr(cpu_gemm, "_cpu_vendor", lambda: "AuthenticAMD")
    shape = {**SHAPE, "vocab_size": 64}
    data = MarkovTokens(vocab_size=64, max_seq_len=128, num_samples=16, seed=1)
    cpu_gemm.configure_cpu_gemm("openblas", "cpu")
    torch.manual_seed(0)
    model = LLM(**shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for _, batch in zip(range(1), torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)):
        loss = model.loss(model(batch), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    expected_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert sgemm_calls
    sgemm_calls.clear()

    rank, world = dist.get_rank(), dist.get_world_size()
    loader = build_dataloader(data, 4 // world, dp_rank=rank, dp_world_size=world, shuffle=False)
    torch.manual_seed(0)
    recorder = Losses()
    sharded = LLM(**shape)
    Trainer(sharded, loader, "1ba", optimizers=functools.partial(torch.optim.SGD, lr=0.1),
            parallelism=FSDP(), callbacks={"losses": recorder}, eval_interval=None, loggers=[],
            progress_bar=False, cpu_gemm="openblas").fit()
    assert sgemm_calls, "FSDP2's unsharded parameters should reach OpenBLAS"
    assert recorder.values == pytest.approx(expected, rel=1e-5)
    for name, value in sharded.state_dict().items():  # the step's grads, through OpenBLAS on both sides
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        torch.testing.assert_close(full, expected_weights[name], rtol=1e-4, atol=1e-5)
