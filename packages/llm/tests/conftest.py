"""Fixtures shared by smalti-llm's LoRA and two-rank tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch


@pytest.fixture
def peft_parity() -> Callable[..., None]:
    """A check that a smalti model which imported a PEFT adapter behaves as PEFT's model does.

    ``check(ours, theirs, source, out, ids)``: equal logits (1e-4) and different from the bare base at
    ``source``, then smalti's merged export, loaded by transformers alone, equal to PEFT's
    ``merge_and_unload()`` (1e-5). The export is written under ``out``.
    """
    import transformers

    from smalti.llm.hf import export_hf
    from smalti.llm.lora.export import merged_model

    def load(folder: Path) -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()

    @torch.no_grad()
    def check(ours: torch.nn.Module, theirs: torch.nn.Module, source: Path, out: Path, ids: torch.Tensor) -> None:
        expected = theirs.eval()(ids).logits
        torch.testing.assert_close(ours({"input_ids": ids})["logits"], expected, atol=1e-4, rtol=1e-4)
        assert (expected - load(source)(ids).logits).abs().max() > 1e-2  # the adapters change the model
        export_hf(merged_model(ours), out / "merged", dtype="float32")
        merged = theirs.merge_and_unload().eval()
        torch.testing.assert_close(load(out / "merged")(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)

    return check


@pytest.fixture
def one_process_losses() -> Callable[..., list[float]]:
    """The one-process side of a two-rank data-parallel test.

    ``train(model, optimizer, samples, steps, batch)``: ``steps`` steps of ``optimizer`` on ``model``, each on the
    global batch the two ranks' sampler deals out (``batch`` samples a rank, rank 0's first); returns the losses.
    """

    def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: list[dict[str, torch.Tensor]],
              steps: int, batch: int) -> list[float]:
        losses = []
        for step in range(steps):
            rows = [samples[2 * (step * batch + i) + r] for r in range(2) for i in range(batch)]
            ids = {"input_ids": torch.stack([s["input_ids"] for s in rows])}
            loss = model.loss(model(ids), ids)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    return train


@pytest.fixture
def gemm_backend(monkeypatch):
    """Sets smalti.core.cpu_gemm's backend for one test (restored after); skips where OpenBLAS cannot apply."""
    from smalti.core import cpu_gemm
    from smalti.core.errors import ConfigError

    monkeypatch.setattr(cpu_gemm, "_backend", cpu_gemm._backend)

    def use(setting: str) -> None:
        try:
            cpu_gemm.configure_cpu_gemm(setting, "cpu", cpu_vendor="AuthenticAMD")
        except ConfigError as err:
            pytest.skip(str(err))

    return use


@pytest.fixture
def openblas_products(monkeypatch) -> list[tuple[int, int, int, float]]:
    """Every OpenBLAS sgemm smalti.core.cpu_gemm makes during the test, as ``(m, k, n, beta)``."""
    from smalti.core import cpu_gemm

    calls: list[tuple[int, int, int, float]] = []
    sgemm = cpu_gemm._openblas_sgemm

    def counted(out, a, b, beta):
        calls.append((a.shape[0], a.shape[1], b.shape[1], beta))
        return sgemm(out, a, b, beta)

    monkeypatch.setattr(cpu_gemm, "_openblas_sgemm", counted)
    return calls


@pytest.fixture
def randomise_adapters() -> Callable[..., None]:
    """Sets every LoRA tensor of a model to seeded random values: fresh adapters start as the base (B = 0), which
    would hide a wrong mapping, and each expert's and rank's values differ, so a swapped axis shows."""

    @torch.no_grad()
    def randomise(model: torch.nn.Module, seed: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    return randomise
