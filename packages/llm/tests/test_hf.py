"""Hugging Face Llama export/import: transformers loads the folder offline and its logits match ours."""

from __future__ import annotations

import json

import pytest
import torch

from smalti.llm import LLM
from smalti.llm.errors import ConversionError
from smalti.llm.hf import export_hf, import_hf

LLAMA = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=2048, max_seq_len=64, ffn_hidden_size=96,
             position="rope", norm_type="rmsnorm", ffn_type="glu", tie_embeddings=False, rope_theta=500000.0,
             rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16})


@pytest.mark.parametrize("tied", [False, True])
def test_exported_folder_loads_in_transformers_with_matching_logits(tmp_path, monkeypatch, tied):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    model = LLM(**{**LLAMA, "tie_embeddings": tied}).eval()
    folder = export_hf(model, tmp_path / "hf", tokenizer="default")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert (folder / "tokenizer.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    ids = torch.randint(0, 2048, (2, 48))
    with torch.no_grad():
        ours = model({"input_ids": ids})["logits"]
        theirs = hf(ids).logits
        back = import_hf(folder).eval()({"input_ids": ids})["logits"]
    assert ours.std() > 0.01
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(back, ours)


def test_non_llama_models_are_refused(tmp_path):
    model = LLM(d_model=64, n_heads=4, n_layers=1, position="alibi")
    with pytest.raises(ConversionError, match="position='alibi'"):
        export_hf(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()
