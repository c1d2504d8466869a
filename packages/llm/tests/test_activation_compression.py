"""model.activation_compression: what a block keeps for backward is stored in bf16 or block-scaled fp8, the
gradients stay those of the uncompressed model to the format's rounding, and the stored bytes shrink."""

from __future__ import annotations

import pytest
import torch

from smalti.core.activation_compression import ActivationCompression, pack_fp8, unpack_fp8
from smalti.llm import LLM
from smalti.llm.errors import ModelConfigError


def tiny(seq_len=512, **kw):
    torch.manual_seed(0)
    return LLM(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=256, max_seq_len=seq_len,
               position="rope", norm_type="rmsnorm", ffn_type="glu", **kw)


def batch(seq_len=512):
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 256, (2, seq_len), generator=g)}


def grads(model):
    model.zero_grad()
    b = batch(model.max_seq_len)
    model.loss(model(b), b).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def stored(model):
    """Saved and stored activation bytes of one training forward (each block's own compression stats)."""
    b = batch(model.max_seq_len)
    for block in model.blocks:
        block.compression.stats.saved_bytes = block.compression.stats.stored_bytes = 0
    model.loss(model(b), b).backward()
    return (sum(block.compression.stats.saved_bytes for block in model.blocks),
            sum(block.compression.stats.stored_bytes for block in model.blocks))


def test_fp8_blocks_round_trip_within_e4m3_rounding():
    t = torch.randn(1000, 77) * torch.logspace(-3, 3, 77)  # columns of very different magnitudes
    values, amax = pack_fp8(t, block=128)
    back = unpack_fp8(values, amax, t.shape, t.dtype)
    assert values.dtype == torch.float8_e4m3fn and values.numel() == 1000 * 77 + (-1000 * 77) % 128
    block_amax = amax.expand(-1, 128).reshape(-1)[: t.numel()].view(t.shape)
    # 3 mantissa bits: half an ulp is 1/16 of the value; values far below their block's largest become subnormal
    assert ((back - t).abs() <= t.abs() / 16 + block_amax * 2.0**-9).all()


@pytest.mark.parametrize(("fmt", "tol"), [("bf16", 1e-2), ("fp8", 8e-2)])
def test_gradients_follow_the_uncompressed_model(fmt, tol):
    reference = grads(tiny())
    compressed = grads(tiny(activation_compression=fmt))
    for name, g in reference.items():
        err = (compressed[name] - g).norm() / g.norm()
        assert err < tol, (name, float(err))


def test_fp8_stores_under_0_3_of_fp32_activations_and_bf16_half():
    saved, fp8 = stored(tiny(activation_compression="fp8"))
    _, bf16 = stored(tiny(activation_compression="bf16"))
    assert saved > 2_000_000  # the blocks' activations were seen (2 x 512 tokens x 64 wide, many of them)
    assert fp8 / saved < 0.3 and bf16 / saved == pytest.approx(0.5, abs=0.02)


def test_granularity_and_layers_choose_what_is_compressed():
    model = tiny(activation_compression={"format": "fp8", "granularity": "ffn", "layers": [1]})
    assert model.blocks[0].compression is None and model.blocks[1].compression_scope == "ffn"
    saved_ffn, _ = stored_of(model, 1)
    whole = tiny(activation_compression={"format": "fp8", "layers": [1]})
    saved_block, _ = stored_of(whole, 1)
    assert 0 < saved_ffn < saved_block  # the FFN's share of what the block keeps
    with pytest.raises(ModelConfigError, match="activation_compression.format='int4' is not one of bf16, fp8"):
        tiny(activation_compression="int4")
    with pytest.raises(ModelConfigError, match="granularity='layer' is not one of block, attention, ffn"):
        tiny(activation_compression={"format": "fp8", "granularity": "layer"})


def stored_of(model, i):
    b = batch(model.max_seq_len)
    model.loss(model(b), b).backward()
    stats = model.blocks[i].compression.stats
    return stats.saved_bytes, stats.stored_bytes


def test_compression_counts_nothing_outside_training():
    model = tiny(activation_compression="fp8")
    with torch.no_grad():
        model(batch())
    assert all(block.compression.stats.tensors == 0 for block in model.blocks)


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="format 'fp4' must be one of none, bf16, fp8"):
        ActivationCompression("fp4")


def train_losses(compression, steps=50, seq_len=128):
    model = tiny(seq_len, activation_compression=compression)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, 64, (4, seq_len), generator=g) for _ in range(4)]  # learnable: 4 repeated batches
    losses = []
    for step in range(steps):
        b = {"input_ids": data[step % 4]}
        loss = model.loss(model(b), b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def plain_losses():
    return train_losses(None)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_fifty_steps_end_within_one_percent_of_uncompressed(fmt, plain_losses):
    plain, compressed = plain_losses, train_losses(fmt)
    assert plain[-1] < 0.8 * plain[0]
    end_plain, end_compressed = sum(plain[-10:]) / 10, sum(compressed[-10:]) / 10
    assert abs(end_compressed - end_plain) / end_plain < 0.01, (end_plain, end_compressed)
