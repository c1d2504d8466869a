"""LoRA adapters of every Hugging Face family smalti imports, named as PEFT names them on the family's
``transformers`` model (the family module in ``smalti.llm.hf`` owns the names): smalti's adapter loaded by
``peft.PeftModel.from_pretrained`` gives smalti's logits, and a PEFT adapter made with ``get_peft_model`` starts a
smalti model with PEFT's logits and merges as PEFT does. Fused q/k/v modules (DBRX's and MPT's ``Wqkv``, GPT-2's
``c_attn``) take a block-diagonal adapter with ``rank_pattern``; GPT-2's ``Conv1D`` sets ``fan_in_fan_out``.
Llama, Mistral and Qwen2: test_lora.py; expert adapters: test_lora_experts.py."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers

from smalti.llm.errors import LoRAError
from smalti.llm.hf import export_hf, import_hf
from smalti.llm.lora import save_adapter
from smalti.testing.hf_models import write_tiny_hf_model

LORA = {"r": 2, "alpha": 4, "dropout": 0.0, "base_dtype": "float32"}
#: family -> (smalti targets for the export test, PEFT target_modules for the import test, smalti's equal targets)
CASES = {
    "qwen3": (["q", "v", "o", "down"], ["q_proj", "v_proj", "o_proj", "down_proj"], ["q", "v", "o", "down"]),
    "gemma3": (["q", "v", "o", "down"], ["q_proj", "v_proj", "o_proj", "down_proj"], ["q", "v", "o", "down"]),
    "mixtral": (["q", "v", "o"], ["q_proj", "v_proj", "o_proj"], ["q", "v", "o"]),
    "qwen3_moe": (["q", "k", "o"], ["k_proj", "o_proj"], ["k", "o"]),
    "olmoe": (["q", "v", "o"], ["q_proj", "v_proj", "o_proj"], ["q", "v", "o"]),
    "qwen2_moe": (["q", "v", "o"], ["q_proj", "v_proj"], ["q", "v"]),
    "dbrx": (["q", "v", "o"], ["Wqkv", "out_proj"], ["q", "k", "v", "o"]),
    "mpt": (["q", "v", "o", "down"], ["Wqkv", "out_proj", "up_proj", "down_proj"], ["q", "k", "v", "o", "up", "down"]),
    "gpt2": (["q", "v", "o"], ["c_attn", "c_proj", "c_fc"], ["q", "k", "v", "o", "up", "down"]),
}
#: the smalti recipes exported as MPT (ALiBi) and GPT-2 (learned positions): their transformers classes here
_MPT_SHAPED = {"d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 4, "max_seq_len": 64,
               "norm_type": "layernorm", "ffn_type": "mlp", "activation": "gelu", "bias": False}


@pytest.fixture(scope="module", params=list(CASES))
def source(request, tmp_path_factory) -> tuple[str, Path]:
    """(family, a tiny random model folder of it)."""
    out = tmp_path_factory.mktemp(request.param) / "hf"
    if request.param in ("mpt", "gpt2"):
        from smalti.llm import LLM

        torch.manual_seed(0)
        model = LLM(**_MPT_SHAPED, vocab_size=320, position="alibi" if request.param == "mpt" else "learned",
                    tie_embeddings=request.param == "mpt", init_device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        return request.param, export_hf(model, out, dtype="float32")
    return request.param, write_tiny_hf_model(out, request.param)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(seed))


def _hf(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()


def test_smalti_adapter_loads_in_peft_with_equal_logits(randomise_adapters, source, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    family, source = source
    targets = CASES[family][0]
    model = import_hf(source, lora={**LORA, "targets": targets}).eval()
    randomise_adapters(model, seed=1)
    folder = save_adapter(model, tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(_hf(source), str(folder)).eval()
    ids = _ids()
    with torch.no_grad():
        ours = model({"input_ids": ids})["logits"]
        torch.testing.assert_close(ours, theirs(ids).logits, atol=1e-4, rtol=1e-4)
        assert (ours - _hf(source)(ids).logits).abs().max() > 1e-2  # the adapters change the model
    # and the folder reads back into smalti as the same adapters
    again = import_hf(source, lora={**LORA, "targets": targets, "init_from": str(folder)}).eval()
    with torch.no_grad():
        torch.testing.assert_close(again({"input_ids": ids})["logits"], ours, atol=1e-5, rtol=1e-5)


def test_peft_adapter_starts_a_smalti_model_and_merges_as_peft_does(randomise_adapters, source, tmp_path, monkeypatch,
                                                                    peft_parity):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    family, source = source
    _, modules, targets = CASES[family]
    theirs = peft.get_peft_model(_hf(source), peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=0.0, use_rslora=True, target_modules=modules, task_type="CAUSAL_LM"))
    randomise_adapters(theirs, seed=2)
    theirs.save_pretrained(str(tmp_path / "peft"))
    ours = import_hf(source, lora={**LORA, "targets": targets, "rslora": True,
                                   "init_from": str(tmp_path / "peft")}).eval()
    peft_parity(ours, theirs, source, tmp_path, _ids(3))


def test_fused_adapter_on_parts_not_adapted_is_refused_naming_the_target(randomise_adapters, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = write_tiny_hf_model(tmp_path / "dbrx", "dbrx")
    theirs = peft.get_peft_model(_hf(source), peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                              target_modules=["Wqkv"], task_type="CAUSAL_LM"))
    randomise_adapters(theirs, seed=2)
    theirs.save_pretrained(str(tmp_path / "peft"))
    with pytest.raises(LoRAError, match="part 'k'.*add k to model.lora.targets"):
        import_hf(source, lora={**LORA, "targets": ["q", "v"], "init_from": str(tmp_path / "peft")})


def test_dbrx_expert_adapters_refuse_the_export_naming_why(tmp_path):
    from smalti.llm.lora.apply import apply_lora, finish_lora_init

    source = write_tiny_hf_model(tmp_path / "dbrx", "dbrx")
    model = import_hf(source)
    apply_lora(model, {**LORA, "targets": ["q", "experts"]})
    finish_lora_init(model)
    with pytest.raises(LoRAError, match="dbrx's experts cannot be written for PEFT: transformers' DbrxExperts"):
        save_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_peft_target_modules_read_as_the_family_names_them(source, tmp_path):
    """What ``smalti-llm generate --adapter`` reads: PEFT's ``target_modules`` on the base's family -> targets."""
    from smalti.llm.hf.importer import PretrainedLLM
    from smalti.llm.lora.peft_format import lora_settings

    family, source = source
    _, modules, targets = CASES[family]
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": modules}))
    base = PretrainedLLM(source, require_tokenizer=False)
    assert lora_settings(tmp_path, base)["targets"] == sorted(targets)
