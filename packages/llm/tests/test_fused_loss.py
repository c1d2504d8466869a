"""The fused chunked linear + cross-entropy: the plain path's loss and gradients, without ``[B, T, vocab]`` logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from smalti.llm import LLM
from smalti.llm.model.fused_loss import fused_linear_cross_entropy


def _inputs(n: int = 37, d: int = 16, v: int = 101) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen, requires_grad=True)
    weight = torch.randn(v, d, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::5] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_equals_plain_cross_entropy(reduction, chunk_rows):
    hidden, weight, targets = _inputs()
    fused = fused_linear_cross_entropy(hidden, weight, targets, reduction=reduction, chunk_rows=chunk_rows)
    got = torch.autograd.grad(fused * 2.5, (hidden, weight))
    plain = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100, reduction=reduction)
    want = torch.autograd.grad(plain * 2.5, (hidden, weight))
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert got[0][targets == -100].abs().max() == 0  # ignored rows get no gradient


def test_without_grad_and_all_ignored():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        value = fused_linear_cross_entropy(hidden, weight, targets)
    torch.testing.assert_close(value, F.cross_entropy(hidden @ weight.T, targets))
    none = torch.full_like(targets, -100)
    loss = fused_linear_cross_entropy(hidden, weight, none)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def _llm(**kw) -> LLM:
    torch.manual_seed(0)
    return LLM(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=257, max_seq_len=64, norm_type="rmsnorm",
               ffn_type="glu", tie_embeddings=False, **kw)


def test_llm_fused_loss_matches_plain_path():
    ids = torch.randint(0, 257, (3, 48), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :10] = -100  # prompt tokens carry no loss
    batch = {"input_ids": ids, "labels": labels}
    results = []
    for fused in (True, False):
        model = _llm(fused_loss=fused).train()
        loss = model.loss(model(batch), batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_f, grads_f), (loss_p, grads_p) = results
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-5, atol=1e-6)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_training_step_never_holds_batch_by_vocab_tensors():
    """Autograd saves nothing of ``B * T * vocab`` elements for backward: the logits are never kept."""
    batch_size, seq, vocab = 2, 48, 257
    ids = torch.randint(0, vocab, (batch_size, seq), generator=torch.Generator().manual_seed(2))
    model = _llm().train()
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(model({"input_ids": ids}), {"input_ids": ids})
    loss.backward()
    assert max(sizes) < batch_size * seq * vocab, f"a saved tensor has {max(sizes)} elements"


def test_a_frozen_bf16_head_under_fp32_is_converted_block_by_block(monkeypatch):
    """QLoRA's frozen bf16 head in an fp32 run: the products run in fp32 on the head converted a few rows at a
    time, never as one whole fp32 copy (525 MB at Llama 3's 128K x 1,024), with the whole-copy path's values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import smalti.llm.model.fused_loss as fused_loss

    monkeypatch.setattr(fused_loss, "CAST_ROWS", 16)
    hidden, weight, targets = _inputs(v=101)
    head = weight.detach().to(torch.bfloat16)  # frozen: no gradient

    class Largest(TorchDispatchMode):
        fp32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2 \
                        and t.shape[1] == head.shape[1]:
                    self.fp32 = max(self.fp32, t.shape[0])
            return out

    with Largest() as seen:
        fused = fused_linear_cross_entropy(hidden, head, targets, chunk_rows=7)
    (grad,) = torch.autograd.grad(fused, hidden)
    assert seen.fp32 < head.shape[0]  # no [vocab, d] fp32 copy of the head was made
    plain = F.cross_entropy(hidden @ head.float().T, targets, ignore_index=-100)
    (want,) = torch.autograd.grad(plain, hidden)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def test_one_chunk_of_logits_is_alive_at_a_time(monkeypatch):
    """Each chunk's logits (268 MB at Llama 3's vocabulary and 523 rows) are freed before the next chunk's are
    made, so the loss adds one chunk to the step's peak, not two."""
    import weakref

    import smalti.llm.model.fused_loss as fused_loss

    made: list[weakref.ref] = []
    alive_at_each: list[int] = []

    def tracked(h, weight, dtype):
        alive_at_each.append(sum(r() is not None for r in made))
        out = _logits(h, weight, dtype)
        made.append(weakref.ref(out))
        return out

    _logits = fused_loss._logits
    monkeypatch.setattr(fused_loss, "_logits", tracked)
    hidden, weight, targets = _inputs()
    loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_rows=7)
    loss.backward()
    assert len(alive_at_each) == 6 and max(alive_at_each) == 0


# Above cpu_gemm.MIN_FLOPS for every product of every chunk (2 * 128 * 64 * 8192 = 2**27 for the first chunk's,
# 2 * 72 * 64 * 8192 for the last's), so that they go to OpenBLAS when it is the backend.
_ROWS, _D, _VOCAB, _CHUNK = 200, 64, 8192, 128


def test_equals_plain_cross_entropy_through_openblas(gemm_backend):
    gemm_backend("openblas")
    hidden, weight, targets = _inputs(n=_ROWS, d=_D, v=_VOCAB)
    fused = fused_linear_cross_entropy(hidden, weight, targets, chunk_rows=_CHUNK)
    got = torch.autograd.grad(fused, (hidden, weight))
    plain = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)
    want = torch.autograd.grad(plain, (hidden, weight))
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("setting", "products"), [("openblas", 6), ("torch", 0)])
def test_the_head_products_go_to_openblas_only_when_it_is_the_backend(gemm_backend, openblas_products, setting,
                                                                     products):
    """The optimisation is on: each chunk's three products (logits, grad of hidden, grad of weight) are OpenBLAS
    sgemm calls with the openblas backend, and none are with torch's."""
    gemm_backend(setting)
    calls = openblas_products
    hidden, weight, targets = _inputs(n=_ROWS, d=_D, v=_VOCAB)
    fused_linear_cross_entropy(hidden, weight, targets, chunk_rows=_CHUNK).backward()
    assert len(calls) == products, calls


def test_a_frozen_bf16_head_converted_by_blocks_feeds_openblas(gemm_backend, openblas_products, monkeypatch):
    """The bf16 head of an fp32 run is converted block by block and each fp32 block's products go to OpenBLAS."""
    import smalti.llm.model.fused_loss as fused_loss

    gemm_backend("openblas")
    monkeypatch.setattr(fused_loss, "CAST_ROWS", _VOCAB // 2)
    hidden, weight, targets = _inputs(n=_CHUNK, d=_D, v=_VOCAB)
    head = weight.detach().to(torch.bfloat16)
    fused = fused_linear_cross_entropy(hidden, head, targets)
    (grad,) = torch.autograd.grad(fused, hidden)
    assert [beta for *_, beta in openblas_products] == [0.0, 0.0, 0.0, 1.0]  # logits by 2 blocks, then grad of hidden by 2 blocks, accumulated
    plain = F.cross_entropy(hidden @ head.float().T, targets, ignore_index=-100)
    (want,) = torch.autograd.grad(plain, hidden)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("frozen", [True, False])
def test_a_frozen_head_keeps_at_most_its_budget_of_logits(monkeypatch, frozen):
    """Against a head that gets no gradient (LoRA, QLoRA) the default chunk holds at most
    ``FROZEN_CHUNK_ELEMENTS`` logits (64 MB in fp32); a trained head keeps the larger ``CHUNK_ELEMENTS`` chunk
    (smaller ones add passes over its gradient). The loss and gradients are the plain path's either way."""
    import smalti.llm.model.fused_loss as fused_loss

    monkeypatch.setattr(fused_loss, "FROZEN_CHUNK_ELEMENTS", 101 * 4)
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", 101 * 16)
    sizes: list[int] = []
    _logits = fused_loss._logits

    def tracked(h, weight, dtype):
        out = _logits(h, weight, dtype)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(fused_loss, "_logits", tracked)
    hidden, weight, targets = _inputs()
    weight.requires_grad_(not frozen)
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    got = torch.autograd.grad(loss, (hidden, weight) if not frozen else (hidden,))
    assert max(sizes) == 101 * (4 if frozen else 16) and sum(sizes) == 37 * 101
    plain = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, torch.autograd.grad(plain, (hidden, weight) if not frozen else (hidden,)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
