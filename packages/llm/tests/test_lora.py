"""LoRA (``model.lora``): smalti's adapters load in PEFT and PEFT's in smalti with equal logits (Llama, Mistral,
Qwen2 shapes), the merged export equals PEFT's ``merge_and_unload()``, only the adapters train (gradients and
optimizer state) while the base stays bit-identical, and bad settings fail naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers

from smalti.llm.errors import LoRAError
from smalti.llm.lora import LoRALinear, save_adapter
from smalti.testing.hf_models import write_tiny_hf_model  # noqa: E402

FAMILIES = ["llama3", "mistral", "qwen2"]
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "base_dtype": "float32"}


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(seed))


def _import(folder: Path, **lora) -> torch.nn.Module:
    from smalti.llm.hf import import_hf

    return import_hf(folder, lora={**LORA, **lora}).eval()


def _hf(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_smalti_adapter_loads_in_peft_with_equal_logits(randomise_adapters, tmp_path, monkeypatch, family):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = write_tiny_hf_model(tmp_path / family, family)
    model = _import(source, modules_to_save=["lm_head"])
    randomise_adapters(model)
    with torch.no_grad():
        model.lm_head.weight.add_(0.05)
    folder = save_adapter(model, tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    theirs = peft.PeftModel.from_pretrained(_hf(source), str(folder)).eval()
    ids = _ids()
    with torch.no_grad():
        ours = model({"input_ids": ids})["logits"]
        base = _hf(source)(ids).logits
        torch.testing.assert_close(ours, theirs(ids).logits, atol=1e-4, rtol=1e-4)
    assert (ours - base).abs().max() > 1e-2  # the adapters change the model


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_starts_a_smalti_model_and_merges_as_peft_does(randomise_adapters, tmp_path, monkeypatch, family,
                                                                    peft_parity):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = write_tiny_hf_model(tmp_path / family, family)
    theirs = peft.get_peft_model(_hf(source), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
        task_type="CAUSAL_LM"))
    randomise_adapters(theirs, seed=2)
    theirs.save_pretrained(str(tmp_path / "peft"))
    ours = _import(source, targets=["q", "v", "down"], rslora=True, init_from=str(tmp_path / "peft"))
    peft_parity(ours, theirs, source, tmp_path, _ids(3))


def test_fused_qkv_adapts_only_the_named_parts(randomise_adapters, tmp_path):
    source = write_tiny_hf_model(tmp_path / "llama", "llama")
    model = _import(source, targets="k")
    wqkv = model.blocks[0].attn.wqkv
    assert isinstance(wqkv, LoRALinear) and list(wqkv.lora_A) == ["k"]
    randomise_adapters(model)
    delta = wqkv.delta_weight()
    q, kv = 64, 32  # 4 heads and 2 key/value heads of 16
    assert delta[:q].abs().max() == 0 and delta[q + kv:].abs().max() == 0 and delta[q:q + kv].abs().max() > 0


@pytest.mark.parametrize(("family", "overrides", "adapted"), [
    ("qwen2", [], 5 + 2),  # wqkv (q, k, v), out_proj, gate, up, down
    # q, k, v, o and each expert's gate_up and down (test_lora_experts.py checks them against PEFT)
    ("mixtral", ["model.lora.targets=[all_linear,experts]", "model.lora.dropout=0"], 6),
])
def test_only_adapters_train_and_the_base_stays_bit_identical(tmp_path, monkeypatch, family, overrides, adapted):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from smalti.core.config.build import build_trainer
    from smalti.core.config.schema import register_configs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    source = write_tiny_hf_model(tmp_path / family, family)
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=[
            "experiment=finetune_hf_lora", f"model.pretrained={source}", "callbacks=[]", "logger=[]",
            "run_name=lora-train", "trainer.max_duration=4ba", "trainer.eval_interval=null", "optimizer.lr=1e-2",
            "model.max_seq_len=64", "data.global_train_batch_size=4", "model.lora.r=8", *overrides])
    trainer = build_trainer(cfg)
    try:
        model = trainer.state.raw_model
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        n_layers = 2
        assert len(adapters) == n_layers * adapted * 2  # lora_A and lora_B per adapted part
        assert all(".lora_A." in n or ".lora_B." in n for n in adapters)
        assert {p.dtype for p in base.values() if p.dim() > 1} == {torch.bfloat16}
        assert {p.dtype for p in adapters.values()} == {torch.float32}
        trainer.fit()
        (optimizer,) = trainer.state.optimizers
        with_state = [p for group in optimizer.param_groups for p in group["params"] if optimizer.state.get(p)]
        assert len(with_state) == len(adapters)
        params = dict(model.named_parameters())
        for name, before in base.items():
            assert params[name].grad is None, name
            assert torch.equal(params[name].detach(), before), name
        moved = [n for n, v in adapters.items() if ".lora_B." in n and not torch.equal(params[n].detach(), v)]
        assert len(moved) == n_layers * adapted, sorted(set(adapters) - set(moved))
    finally:
        trainer.close()


@pytest.mark.parametrize(("lora", "named"), [
    ({"targets": ["q", "qq"]}, "'qq' is not a target"),
    ({"modules_to_save": ["norm_f"]}, "'norm_f' is not a module"),
    ({"r": 0}, "model.lora.r=0"),
    ({"base_dtype": "int8"}, "model.lora.base_dtype='int8'"),
    ({"rank": 8}, "model.lora.rank is not a LoRA setting"),
])
def test_bad_lora_settings_name_the_key(lora, named):
    from smalti.llm import LLM

    with pytest.raises(LoRAError, match=named.replace("(", r"\(").replace("[", r"\[")):
        LLM(d_model=64, n_heads=4, n_layers=1, vocab_size=64, ffn_type="glu", lora=lora, init_device="meta")


def test_init_from_with_other_rank_says_which_setting_to_change(tmp_path):
    source = write_tiny_hf_model(tmp_path / "llama", "llama")
    save_adapter(_import(source), tmp_path / "adapter")
    with pytest.raises(LoRAError, match=r"r=4 but model.lora.r=8; set model.lora.r=4"):
        _import(source, r=8, init_from=str(tmp_path / "adapter"))
    with pytest.raises(LoRAError, match="missing .*set model.lora.targets"):
        _import(source, targets="q", init_from=str(tmp_path / "adapter"))


def test_generate_with_an_adapter_gives_peft_greedy_tokens(randomise_adapters, tmp_path, monkeypatch, capsys):
    from smalti.llm.cli import main
    from smalti.llm.hf_tokenizer import HFTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = write_tiny_hf_model(tmp_path / "llama3", "llama3")
    theirs = peft.get_peft_model(_hf(source), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "o_proj", "up_proj"], task_type="CAUSAL_LM"))
    randomise_adapters(theirs, seed=4)
    theirs.save_pretrained(str(tmp_path / "peft"))
    prompt = "The old clockmaker mended a blue lantern by the river"
    ids = HFTokenizer.from_folder(source).encode(prompt, add_special_tokens=True)
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        expected = theirs.eval().generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                          max_new_tokens=16)[0, len(ids):].tolist()
        plain = _hf(source).generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=16)[0, len(ids):].tolist()
    assert expected != plain  # the adapter changes what is generated
    tok = HFTokenizer.from_folder(source)
    capsys.readouterr()
    argv = ["generate", "--model", str(source), "--prompt", prompt, "--max-new-tokens", "16"]
    assert main([*argv, "--adapter", str(tmp_path / "peft")]) == 0
    assert capsys.readouterr().out == tok.decode(expected) + "\n"
    assert main([*argv, "--adapter", str(tmp_path)]) == 2
    assert "has no adapter_config.json" in capsys.readouterr().err


def _saved_bytes_and_grads(layer: LoRALinear, x: torch.Tensor) -> tuple[list[tuple], tuple[torch.Tensor, ...]]:
    """What autograd saves for backward in ``layer``'s forward (dtype, shape), and the gradients of ``x`` and the
    adapters."""
    saved: list[tuple] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    params = (x, *layer.lora_A.values(), *layer.lora_B.values())
    return saved, torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1])).sum(), params)


def test_a_bf16_base_under_fp32_saves_its_bf16_weight_not_an_fp32_copy():
    """A frozen bf16 base in an fp32 run keeps for backward the bf16 weight it already holds, not the fp32 copy
    ``F.linear(x, w.float())`` would keep (twice the stored bytes, for each layer not checkpointed); the
    gradients are those of the fp32 products."""
    torch.manual_seed(0)
    base = torch.nn.Linear(48, 40, bias=True)
    base.weight.requires_grad_(False)
    base.bias.requires_grad_(False)
    fp32 = LoRALinear(base, [("q", 0, 16), ("k", 16, 40)], ["q", "k"], r=4, scaling=2.0)
    with torch.no_grad():
        for b in fp32.lora_B.values():
            b.normal_()
    bf16 = LoRALinear(torch.nn.Linear(48, 40), [("q", 0, 16), ("k", 16, 40)], ["q", "k"], r=4, scaling=2.0)
    bf16.weight = torch.nn.Parameter(base.weight.detach().bfloat16(), requires_grad=False)
    bf16.bias = torch.nn.Parameter(base.bias.detach().bfloat16(), requires_grad=False)
    bf16.load_state_dict({k: v for k, v in fp32.state_dict().items() if "lora_" in k}, strict=False)
    x = torch.randn(3, 5, 48, requires_grad=True)
    saved, got = _saved_bytes_and_grads(bf16, x)
    fp32_weights = [s for d, s in saved if d == torch.float32 and sorted(s) == [40, 48]]  # the weight or its .T
    assert not fp32_weights and (torch.bfloat16, (40, 48)) in saved, saved
    # the reference: the same bf16-rounded base as fp32 weights
    with torch.no_grad():
        fp32.weight.copy_(bf16.weight.float())
        fp32.bias.copy_(bf16.bias.float())
    _, want = _saved_bytes_and_grads(fp32, x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("setting", "products"), [("openblas", 2), ("torch", 0)])
def test_the_base_products_go_to_openblas_only_when_it_is_the_backend(gemm_backend, openblas_products, base_dtype,
                                                                     setting, products):
    """A frozen base's forward and grad-input products (fp32, or a bf16 base upcast under fp32) are OpenBLAS sgemm
    calls with smalti.core.cpu_gemm's openblas backend, none with torch's; the gradients are F.linear's."""
    gemm_backend(setting)
    calls = openblas_products
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 512)  # 2 * 256 * 256 * 512 = cpu_gemm.MIN_FLOPS
    base.weight = torch.nn.Parameter(base.weight.detach().to(base_dtype), requires_grad=False)
    base.bias = torch.nn.Parameter(base.bias.detach().to(base_dtype), requires_grad=False)
    layer = LoRALinear(base, [("q", 0, 512)], ["q"], r=4, scaling=2.0)
    x = torch.randn(256, 256, requires_grad=True)
    y = layer(x)
    (grad,) = torch.autograd.grad(y.square().sum(), x)
    assert len(calls) == products, calls
    x2 = x.detach().requires_grad_(True)
    want_y = F.linear(x2, layer.weight.float(), layer.bias.float()) + F.linear(
        F.linear(x2, layer.lora_A["q"]), layer.lora_B["q"]) * 2.0
    (want,) = torch.autograd.grad(want_y.square().sum(), x2)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-3)
