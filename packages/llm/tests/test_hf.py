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
    import transformers
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
    model = LLM(d_model=64, n_heads=4, n_layers=1, position="alibi", norm_type="rmsnorm")  # no family has it
    with pytest.raises(ConversionError, match="position='alibi'"):
        export_hf(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("tied", "attention_bias", "mlp_bias"), [
    (False, False, False), (True, False, False), (False, True, False), (True, False, True),
], ids=["untied", "tied", "attention_bias", "tied-mlp_bias"])
def test_import_of_a_folder_written_by_transformers(tmp_path, monkeypatch, tied, attention_bias, mlp_bias):
    """A folder written by transformers itself (save_pretrained of a random LlamaForCausalLM) imports into a
    model whose logits equal transformers' on the same tokens."""
    import transformers
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        attention_bias=attention_bias, mlp_bias=mlp_bias,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts biases at zero and norms at one: make every tensor count
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["tie_word_embeddings"] is tied and saved["mlp_bias"] is mlp_bias

    def no_random_init(self):
        raise AssertionError("import_hf built a randomly initialised model before loading the weights")

    with monkeypatch.context() as patch:
        patch.setattr(LLM, "init_weights", no_random_init)
        model = import_hf(tmp_path / "hf").eval()
    assert model.config["tie_embeddings"] is tied
    assert (model.blocks[0].attn.wqkv.bias is not None) is attention_bias
    assert (model.blocks[0].ffn.up_proj.bias is not None) is mlp_bias
    assert model.n_params == sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model({"input_ids": ids})["logits"]
    assert theirs.std() > 0.1
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # And back: our export of the imported model loads in transformers with the same logits.
    back = transformers.AutoModelForCausalLM.from_pretrained(str(export_hf(model, tmp_path / "again")),
                                                            local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, theirs, atol=1e-4, rtol=1e-4)


def test_import_names_a_missing_weight(tmp_path):
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, mlp_bias=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="model.layers.0.mlp.up_proj.bias"):
        import_hf(tmp_path)


def test_export_writes_a_live_models_whole_parameters_without_copying_them(tmp_path, monkeypatch):
    """The export runs at fit end on top of the weights, gradients and optimizer state: whole parameters go to
    safetensors by reference, and only the slices of fused tensors (q/k/v of ``wqkv``) are copied."""
    import safetensors.torch

    real_save = safetensors.torch.save_file
    written: dict[str, int] = {}

    def recording_save(tensors, filename, metadata=None):
        written.update({k: v.untyped_storage().data_ptr() for k, v in tensors.items()})
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", recording_save)
    torch.manual_seed(0)
    model = LLM(**LLAMA)
    folder = export_hf(model, tmp_path / "hf", tokenizer="default", max_shard_size="200KB")
    assert (folder / "model.safetensors.index.json").is_file()  # several shards: each starts a new set of storages
    storages = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
    by_reference = {hf for hf, ptr in written.items() if ptr in storages}
    fused = {hf for hf in written if hf.split(".")[-2] in ("q_proj", "k_proj", "v_proj")}
    assert len(fused) == 3 * LLAMA["n_layers"]
    assert by_reference == set(written) - fused
    back = import_hf(folder)
    for (name, ours), (_, theirs) in zip(model.named_parameters(), back.named_parameters(), strict=True):
        torch.testing.assert_close(theirs, ours, rtol=0, atol=0, msg=name)
