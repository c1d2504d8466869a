"""The elementwise work of a training step stays as lean as measured by bench/llm_vs_hf.py (Gemma 3 / Qwen3 at
vocab 32000, seq 512), with the same bits as the plain formulas.

Each test counts the ATen operations a piece runs (a ``TorchDispatchMode``), so that switching an optimisation
off fails here rather than as a few percent of a benchmark on a loaded machine.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from smalti.llm import LLM
from smalti.llm.model.fused_loss import fused_linear_cross_entropy
from smalti.llm.model.position import Rotary, apply_rotary, apply_rotary_signed


class _Ops(TorchDispatchMode):
    """Records ``(op name, output shape)`` of every ATen call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
        self.calls.append((func.overloadpacket.__name__, shape))
        return out

    def names(self) -> Counter:
        return Counter(name for name, _ in self.calls)


def _plain_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def test_rotary_has_the_plain_formulas_bits_without_concatenation_or_zero_filled_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, 24, 3, 16, requires_grad=True)
    grad = torch.randn(2, 24, 3, 16)
    cos, sin = Rotary(16, 10000.0).tables(24, 0, x.device, torch.float32)
    cos, sin = cos[:, None], sin[:, None]
    ref = _plain_rotary(x, cos, sin)
    (ref_grad,) = torch.autograd.grad(ref, x, grad)
    with _Ops() as ops:
        out = apply_rotary(x, cos, sin)
        (out_grad,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(out, ref) and torch.equal(out_grad, ref_grad)
    # The plain formula negates and concatenates x-sized halves in forward, and in backward its two slice
    # gradients each fill an x-sized zero buffer. (The signed table, [T, 1, D], is built here from sin;
    # Rotary.tables caches it for the model.)
    on_x = [name for name, shape in ops.calls if shape == tuple(x.shape)]
    assert not {"neg", "cat", "fill_", "zero_", "zeros", "slice_backward", "new_zeros"} & set(on_x), on_x
    assert sorted(on_x) == sorted(["mul", "roll", "mul", "add_"] * 2), on_x  # forward, then backward


def test_attention_rotates_with_the_cached_signed_table():
    """The model's layers pass the signed table :meth:`Rotary.tables` caches: no table work per layer."""
    rot = Rotary(16, 10000.0)
    cos, signed = rot.tables(24, 0, torch.device("cpu"), torch.float32, signed=True)
    assert rot.tables(24, 0, torch.device("cpu"), torch.float32, signed=True)[1] is signed
    plain_sin = rot.tables(24, 0, torch.device("cpu"), torch.float32)[1]
    assert torch.equal(signed[:, :8], -plain_sin[:, :8]) and torch.equal(signed[:, 8:], plain_sin[:, 8:])
    model = LLM(d_model=32, n_heads=2, n_kv_heads=1, n_layers=2, vocab_size=64, max_seq_len=24, position="rope")
    ids = torch.randint(0, 64, (2, 24))
    model({"input_ids": ids})  # fills the tables' cache
    with _Ops() as ops:
        model.loss(model({"input_ids": ids}), {"input_ids": ids}).backward()
    assert ops.names()["neg"] == 0 and ops.names()["roll"] == 2 * 2 * 2  # q and k, forward and backward, 2 layers
    x = torch.randn(1, 24, 2, 16)
    assert torch.equal(apply_rotary_signed(x, cos[:, None], signed[:, None]), _plain_rotary(x, cos[:, None],
                                                                                            plain_sin[:, None]))


@pytest.mark.parametrize("ignored", [False, True])
def test_fused_loss_makes_one_pass_for_the_logit_gradient_and_fills_no_weight_gradient(ignored):
    """One multiply of the ``[rows, vocab]`` buffer turns it into the masked softmax gradient (not a second pass
    for the ignored rows), and the first chunk's product writes the weight gradient (no zero fill of it)."""
    torch.manual_seed(0)
    rows, vocab, d = 40, 300, 8
    h = torch.randn(rows, d, requires_grad=True)
    w = torch.randn(vocab, d, requires_grad=True)
    t = torch.randint(0, vocab, (rows,))
    if ignored:
        t[::3] = -100
    ref = torch.nn.functional.cross_entropy(h @ w.t(), t, ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, (h, w))
    with _Ops() as ops:
        loss = fused_linear_cross_entropy(h, w, t, chunk_rows=16)
        grads = torch.autograd.grad(loss, (h, w))
    torch.testing.assert_close(loss, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    big = [name for name, shape in ops.calls if len(shape) == 2 and shape[1] == vocab and name in ("mul", "mul_")]
    assert len(big) == 3, big  # one per chunk of 16 rows: 16, 16, 8
    fills = [(name, shape) for name, shape in ops.calls if shape == (vocab, d) and name in ("zeros", "zero_", "fill_")]
    assert not fills, fills


def test_local_layers_whose_window_covers_the_sequence_take_the_causal_path():
    """Gemma 3 at seq <= sliding_window (the bench's 512 / 512): every layer, local or global, runs one
    ``is_causal`` SDPA call per forward, with no mask or bias tensor built."""
    model = LLM(d_model=32, n_heads=2, n_kv_heads=1, n_layers=2, vocab_size=64, max_seq_len=24, position="rope",
                sliding_window=24, window_layers=[True, False])
    ids = torch.randint(0, 64, (2, 24))
    with _Ops() as ops:
        model({"input_ids": ids})
    sdpa = [name for name, _ in ops.calls if "scaled_dot_product" in name]
    assert len(sdpa) == 2, sdpa
    assert not [shape for _, shape in ops.calls if shape[-2:] == (24, 24)]  # no [T, T] mask or bias
