"""MPT-recipe models exported as folders that transformers loads natively (MptForCausalLM, GPT2LMHeadModel)."""

from __future__ import annotations

import pytest
import torch
import transformers

from smalti.llm import LLM  # noqa: E402
from smalti.llm.errors import ConversionError  # noqa: E402
from smalti.llm.hf import export_hf, import_hf  # noqa: E402
from smalti.llm.hf.families.mpt import mpt_family  # noqa: E402
from smalti.llm.tokenizer import load_tokenizer  # noqa: E402

MPT_RECIPE = {"d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 4, "max_seq_len": 64,
              "norm_type": "low_precision_layernorm", "ffn_type": "mlp", "activation": "gelu", "bias": False,
              "tie_embeddings": True}


def _model(**overrides) -> LLM:
    vocab = load_tokenizer("default").vocab_size
    torch.manual_seed(0)
    model = LLM(**{**MPT_RECIPE, "vocab_size": vocab, **overrides}, init_device="cpu").eval()
    with torch.no_grad():  # non-trivial norms, so a swapped or dropped norm weight shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize(("position", "extra", "cls"), [
    ("learned", {}, "GPT2LMHeadModel"),                       # the mpt_* recipes as shipped
    ("learned", {"tie_embeddings": False}, "GPT2LMHeadModel"),
    ("alibi", {}, "MptForCausalLM"),                          # MPT-7B's published shape
    ("alibi", {"n_heads": 8, "clip_qkv": 6.0}, "MptForCausalLM"),
])
def test_export_loads_in_transformers_with_the_same_logits_and_round_trips(tmp_path, position, extra, cls):
    model = _model(position=position, **extra)
    folder = export_hf(model, tmp_path / "hf", tokenizer="default")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    assert type(hf).__name__ == cls
    ids = torch.randint(0, model.config["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model({"input_ids": ids})["logits"]
        torch.testing.assert_close(hf(ids).logits, ours, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(import_hf(folder)({"input_ids": ids})["logits"], ours, rtol=0, atol=1e-5)


def test_exported_tokenizer_loads_with_its_special_tokens(tmp_path):
    folder = export_hf(_model(position="learned"), tmp_path / "hf", tokenizer="default")
    ours = load_tokenizer("default")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert tok.eos_token_id == ours.eos_id and tok.pad_token_id is not None
    assert tok("a small test")["input_ids"] == ours.encode("a small test")
    assert transformers.GenerationConfig.from_pretrained(str(folder)).eos_token_id == ours.eos_id


@pytest.mark.parametrize(("overrides", "named"), [
    ({"position": "rope"}, "position='rope'"),
    ({"position": "alibi", "bias": True}, "bias=true with ALiBi"),
    ({"position": "learned", "ffn_type": "glu", "activation": "silu"}, "GELU mlp"),
    ({"position": "learned", "n_kv_heads": 2}, "grouped-query"),
])
def test_a_model_of_another_shape_is_refused_naming_why(overrides, named):
    with pytest.raises(ConversionError, match=named):
        mpt_family(_model(**overrides))
