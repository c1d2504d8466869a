"""``model=hf``: Llama, Mistral and Qwen2 folders written by ``transformers`` import into smalti's model with
equal logits; fields smalti cannot reproduce, Hub names and missing files fail at build time naming the thing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from smalti.llm.errors import ConversionError
from smalti.llm.hf import PretrainedLLM, import_hf
from smalti.testing.hf_models import write_tiny_hf_model  # noqa: E402

SEQ = 40  # longer than the Mistral window (16), so the window changes the result


def _logits_both(folder: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    model = import_hf(folder).eval()
    with torch.no_grad():
        return model({"input_ids": ids})["logits"], hf(ids).logits, model


@pytest.mark.parametrize(("family", "overrides"), [
    ("llama", {}),
    ("llama3", {"tie_word_embeddings": True}),
    ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("llama", {"head_dim": 32}),
    ("qwen3", {}),
    ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("gemma3", {}),
    ("gemma3", {"tie_word_embeddings": True, "num_hidden_layers": 3,
                "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}),
], ids=["llama2", "llama3-rope_scaling-tied", "llama-mqa-biases", "mistral-sliding_window", "qwen2-qkv_bias",
        "qwen2-tied-mha", "llama-wide-heads", "qwen3-qk_norm-head_dim", "qwen3-attention_bias-tied",
        "qwen3-sliding_window", "gemma3-local-global", "gemma3-tied-3-layers"])
def test_import_gives_transformers_logits(tmp_path, monkeypatch, family, overrides):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = write_tiny_hf_model(tmp_path / family, family, **overrides)
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ours, theirs, model = _logits_both(folder, ids)
    assert theirs.std() > 0.1
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    assert model.n_params == sum(p.numel() for p in hf.parameters())
    cfg = json.loads((folder / "config.json").read_text())
    assert model.config["tie_embeddings"] is cfg["tie_word_embeddings"]
    if family == "mistral":
        assert model.sliding_window == 16 < SEQ
    if family == "qwen2":
        attn = model.blocks[0].attn
        assert attn.wqkv.bias is not None and attn.out_proj.bias is None
    if family == "qwen3":
        attn = model.blocks[0].attn
        assert attn.q_norm is not None and attn.head_dim == 32 != model.d_model // model.n_heads


def test_qwen2_sliding_window_on_every_layer_is_reproduced(tmp_path):
    folder = write_tiny_hf_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    ours, theirs, model = _logits_both(folder, ids)
    assert model.sliding_window == 8
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def _edit_config(folder: Path, **changes) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(("changes", "named"), [
    ({"model_type": "bert"}, "model_type='bert'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type='dynamic'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_fields_smalti_cannot_reproduce_fail_at_build_naming_them(tmp_path, changes, named):
    folder = _edit_config(write_tiny_hf_model(tmp_path, "llama"), **changes)
    with pytest.raises(ConversionError, match=named.replace("(", r"\(").replace("[", r"\[")) as info:
        PretrainedLLM(folder)
    assert str(folder / "config.json") in str(info.value)


@pytest.mark.parametrize(("changes", "named"), [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
])
def test_gemma3_fields_smalti_cannot_reproduce_fail_at_build_naming_them(tmp_path, changes, named):
    folder = _edit_config(write_tiny_hf_model(tmp_path, "gemma3"), **changes)
    with pytest.raises(ConversionError, match=named) as info:
        PretrainedLLM(folder)
    assert str(folder / "config.json") in str(info.value)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_mixed_sliding_window_layers_are_refused(tmp_path, family):
    folder = write_tiny_hf_model(tmp_path, family, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ConversionError, match="max_window_layers=1"):
        PretrainedLLM(folder)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "dbrx"])
def test_export_of_an_imported_family_is_that_family_with_equal_logits(tmp_path, family):
    """A trained step later, the export is the source's family again and transformers' logits equal smalti's,
    through the source's config.json and, for a smalti-built model, through the family's own."""
    from smalti.llm.hf import export_hf

    source = write_tiny_hf_model(tmp_path / "src", family)
    model = import_hf(source)
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids}
    model.loss(model(batch), batch).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.eval()
    bare = import_hf(source).eval()
    bare.load_state_dict(model.state_dict())
    del bare.hf_folder, bare.hf_config  # as if built by smalti: the family comes from its shape
    for name, which in (("from-source", model), ("from-shape", bare)):
        out = export_hf(which, tmp_path / name)
        source_type = json.loads((source / "config.json").read_text())["model_type"]
        assert json.loads((out / "config.json").read_text())["model_type"] == source_type
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
        with torch.no_grad():
            ours = model({"input_ids": ids})["logits"]
            torch.testing.assert_close(hf(ids).logits, ours, atol=1e-4, rtol=1e-4)


def test_hub_name_missing_tokenizer_and_missing_weights_are_explained(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConversionError, match="Hugging Face Hub name") as info:
        PretrainedLLM("meta-llama/Llama-3.2-1B")
    message = str(info.value)
    assert "only reads local folders" in message and "huggingface-cli download meta-llama/Llama-3.2-1B" in message
    with pytest.raises(ConversionError, match="not an existing folder"):
        PretrainedLLM(tmp_path / "nowhere")

    folder = write_tiny_hf_model(tmp_path / "m", "llama")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConversionError, match="has no tokenizer.json"):
        PretrainedLLM(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConversionError, match="neither model.safetensors"):
        PretrainedLLM(folder, require_tokenizer=False)


def test_only_function_preserving_overrides_are_accepted(tmp_path):
    folder = write_tiny_hf_model(tmp_path, "llama")
    model = PretrainedLLM(folder, max_seq_len=64, activation_checkpointing=True)
    assert model.max_seq_len == 64 and all(p.is_meta for p in model.parameters())
    with pytest.raises(ConversionError, match="model.d_model cannot be set for model=hf"):
        PretrainedLLM(folder, d_model=128)


def test_export_dtype_defaults_to_the_source_torch_dtype(tmp_path):
    from safetensors import safe_open

    from smalti.llm.hf import export_model

    folder = _edit_config(write_tiny_hf_model(tmp_path / "src", "mistral"), dtype="bfloat16")
    model = import_hf(folder)
    for out, dtype, expected in ((tmp_path / "a", None, torch.bfloat16), (tmp_path / "b", "float16", torch.float16)):
        export_model(model, out, dtype=dtype)
        config = json.loads((out / "config.json").read_text())
        assert config["dtype"] == str(expected).removeprefix("torch.") and config["sliding_window"] == 16
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {expected}  # noqa: SIM118 (not iterable)
        assert transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).dtype == expected
    with pytest.raises(ConversionError, match="hf_export.dtype='int8'"):
        export_model(model, tmp_path / "c", dtype="int8")
    assert not (tmp_path / "c").exists()
