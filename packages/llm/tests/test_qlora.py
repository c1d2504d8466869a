"""QLoRA (``model.lora.base_dtype=nf4``): the frozen base as torchao's NF4Tensor (64-value blocks, double-quantised
scales): the round trip and the product stay within the format's error of the bf16 reference, and a step trains
the adapters only, through the dequantised base."""

from __future__ import annotations

import torch

from smalti.llm import LLM  # noqa: E402
from smalti.llm.lora.layer import LoRALinear, is_nf4  # noqa: E402

SHAPE = dict(d_model=128, n_heads=4, n_layers=2, vocab_size=128, ffn_type="glu", norm_type="rmsnorm")


def _pair() -> tuple[LLM, LLM]:
    torch.manual_seed(0)
    ref = LLM(**SHAPE, lora={"r": 4, "dropout": 0.0, "base_dtype": "bfloat16"})
    quant = LLM(**SHAPE, lora={"r": 4, "dropout": 0.0, "base_dtype": "nf4"}, init_device="meta")
    quant.to_empty(device="cpu")
    quant.load_state_dict({k: v for k, v in ref.state_dict().items()}, strict=False)
    from smalti.llm.lora.apply import quantize_base

    quantize_base(quant)
    return ref, quant


def test_nf4_round_trip_and_product_are_within_the_formats_error():
    ref, quant = _pair()
    layer, base = quant.blocks[0].ffn.up_proj, ref.blocks[0].ffn.up_proj
    assert isinstance(layer, LoRALinear) and is_nf4(layer.weight)
    w = base.weight.float()
    back = layer.base_weight(torch.float32)
    # NF4's 16 levels over each block's absmax: the widest gap (-1 to -0.696) rounds by at most 0.152 of it,
    # plus the int8 double-quantised absmax's own rounding
    blocks = w.reshape(-1, 64)
    err = (back.reshape(-1, 64) - blocks).abs().max(dim=1).values / blocks.abs().max(dim=1).values
    assert err.max() < 0.17 and err.mean() < 0.12
    assert (back - w).abs().mean() / w.abs().mean() < 0.12
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(layer(x), x @ back.t(), atol=1e-5, rtol=1e-5)  # the product is the dequantised one
    # memory: 4 bits a weight plus the scales (~0.13 bit a weight), against 16 for bf16
    nf4 = layer.weight
    held = nf4.quantized_data.numel() + nf4.quantized_scalers.numel() + nf4.quantization_factor.numel() * 4
    assert held / w.numel() < 0.52


def test_qlora_step_trains_adapters_through_the_nf4_base():
    ref, quant = _pair()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref.eval()({"input_ids": ids})["logits"], quant.eval()({"input_ids": ids})["logits"]
    assert (a - b).abs().max() < 0.05 * a.abs().max()  # the same model, up to NF4's rounding
    quant.train()
    before = {n: p.detach().clone() for n, p in quant.named_parameters() if not p.requires_grad}
    out = quant({"input_ids": ids})
    quant.loss(out, {"input_ids": ids}).backward()
    grads = {n for n, p in quant.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)
    assert any(quant.get_parameter(n).grad.abs().sum() > 0 for n in grads if ".lora_B." in n)
    for name, value in before.items():
        now = quant.get_parameter(name)
        assert now.grad is None
        if is_nf4(now):
            assert torch.equal(now.quantized_data, value.quantized_data)
