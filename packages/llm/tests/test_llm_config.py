"""LLMConfig is the one place an LLM option is written: a new field reaches the model, the config schema, the
model's ``config`` and exported folders with nothing else to edit; folders exported before it still load."""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from pydantic_core import PydanticUndefined
from safetensors.torch import load_file

from smalti.core.config.derive import checkable
from smalti.llm import LLM
from smalti.llm.config_schema import LLMSchema
from smalti.llm.errors import ModelConfigError
from smalti.llm.export import load_model_folder, save_model_folder
from smalti.llm.model.config import LLMConfig, field_names

FIXTURES = Path(__file__).parent / "fixtures"
BASE = {"d_model": 16, "n_heads": 2, "n_layers": 2, "vocab_size": 32, "max_seq_len": 16, "norm_type": "rmsnorm"}

#: For each field, options (on top of BASE) giving it a value other than its default. A new field needs a line
#: here, and nothing else needs to change for these tests to pass.
CHANGED: dict[str, dict] = {
    "d_model": {"d_model": 32},
    "n_heads": {"n_heads": 4},
    "n_layers": {"n_layers": 3},
    "vocab_size": {"vocab_size": 40},
    "max_seq_len": {"max_seq_len": 24},
    "n_kv_heads": {"n_kv_heads": 1},
    "expansion_ratio": {"expansion_ratio": 2},
    "ffn_hidden_size": {"ffn_hidden_size": 24},
    "position": {"position": "alibi"},
    "rope_theta": {"rope_theta": 500000.0},
    "rope_scaling": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "alibi_bias_max": {"position": "alibi", "alibi_bias_max": 4.0},
    "qk_norm": {"qk_norm": True},
    "clip_qkv": {"clip_qkv": 6.0},
    "softmax_scale": {"softmax_scale": 0.5},
    "bias": {"bias": True},
    "attn_bias": {"attn_bias": True},
    "ffn_bias": {"ffn_bias": True},
    "qkv_bias": {"qkv_bias": True},
    "sliding_window": {"sliding_window": 4},
    "norm_type": {"norm_type": "layernorm"},
    "norm_eps": {"norm_eps": 1e-6},
    "ffn_type": {"ffn_type": "glu"},
    "activation": {"activation": "relu"},
    "moe": {"ffn_type": "moe", "moe": {"num_experts": 2, "top_k": 1}},
    "tie_embeddings": {"tie_embeddings": False},
    "attn_uses_sequence_id": {"attn_uses_sequence_id": False},
    "activation_checkpointing": {"activation_checkpointing": "block"},
    "activation_compression": {"activation_compression": "bf16"},
    "init_device": {"init_device": "cpu"},
    "init_std": {"init_std": 0.01},
    "fused_loss": {"fused_loss": False},
    "sparse_embedding_grad": {"sparse_embedding_grad": False},
    "head_dim": {"head_dim": 4},
    "lora": {"lora": {"r": 2, "alpha": 4.0, "targets": ["q", "v"], "base_dtype": "float32"}},
    "embed_scale": {"embed_scale": 2.0},
    "post_norms": {"post_norms": True},
    "window_layers": {"sliding_window": 4, "window_layers": [True, False]},
    "rope_local_theta": {"rope_local_theta": 1000.0},
    "qk_norm_scope": {"qk_norm": True, "qk_norm_scope": "all"},
}
STORED = [f.name for f in dataclasses.fields(LLMConfig) if f.metadata.get("stored", True)]


def test_every_field_has_a_changed_value_here():
    assert list(CHANGED) == list(field_names())
    for name, options in CHANGED.items():
        default = next(f.default for f in dataclasses.fields(LLMConfig) if f.name == name)
        assert options[name] != BASE.get(name, default), name


def test_the_schema_has_the_dataclass_fields_and_defaults_and_no_other():
    hints = typing.get_type_hints(LLMConfig, include_extras=True)
    unchecked = [name for name in field_names() if name not in ("moe", "lora") and not checkable(hints[name])]
    assert unchecked == ["rope_scaling", "activation_checkpointing", "activation_compression"]  # Any inside
    assert list(LLMSchema.model_fields) == [name for name in field_names() if name not in unchecked]
    for f in dataclasses.fields(LLMConfig):
        if f.name in LLMSchema.model_fields:
            info = LLMSchema.model_fields[f.name]
            assert info.default is not PydanticUndefined and info.default == f.default, f.name
    # and the model's signature shows them all (what tests/test_schema_defaults.py compares the schema with)
    parameters = inspect.signature(LLM).parameters
    assert [p for p in parameters if p != "config"] == list(field_names())
    assert all(parameters[f.name].default == f.default for f in dataclasses.fields(LLMConfig))


@pytest.mark.parametrize("name", list(CHANGED))
def test_a_field_is_accepted_by_the_schema_and_reaches_the_model_config(name):
    options = {**BASE, **CHANGED[name]}
    LLMSchema.model_validate(options)
    model = LLM(**options)
    assert getattr(model.config, name) == options[name]
    assert model.config[name] == options[name]  # the mapping view the families read
    assert LLM(LLMConfig(**options)).config == model.config  # the dataclass and the keywords build the same


@pytest.mark.parametrize("name", STORED)
def test_a_stored_field_survives_an_export_round_trip(name, tmp_path):
    model = LLM(**{**BASE, **CHANGED[name]}).eval()
    folder = save_model_folder(model, tmp_path / "out", tokenizer=None)
    loaded = load_model_folder(folder)
    assert loaded.config.architecture()[name] == model.config.architecture()[name]
    ids = torch.arange(8).reshape(1, 8) % model.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(loaded({"input_ids": ids})["logits"], model({"input_ids": ids})["logits"])


def test_a_folder_exported_before_llm_config_loads_and_computes_the_same():
    folder = FIXTURES / "smalti_llm_v0"  # written by save_model_folder when LLM.config was a dict
    model = load_model_folder(folder)
    assert model.config.architecture() == json.loads((folder / "smalti_llm.json").read_text())["model"]
    expected = load_file(str(folder / "expected_logits.safetensors"))
    with torch.no_grad():
        logits = model({"input_ids": expected["input_ids"]})["logits"]
    torch.testing.assert_close(logits, expected["logits"])


def test_bad_options_name_the_key_in_the_model_and_in_the_schema():
    with pytest.raises(ModelConfigError, match="model.d_modle is not an option.*did you mean d_model"):
        LLM(d_modle=64)
    with pytest.raises(ModelConfigError, match=r"model.n_kv_heads=3: expected a divisor of model.n_heads=4"):
        LLMConfig(d_model=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValidationError, match=r"n_kv_heads=3: expected a divisor of model.n_heads=4"):
        LLMSchema.model_validate({"d_model": 64, "n_heads": 4, "n_kv_heads": 3})
    with pytest.raises(ValidationError, match="rope_theta"):
        LLMSchema.model_validate({"rope_theta": -1.0})
    with pytest.raises(ValidationError, match="qk_norm_scope"):
        LLMSchema.model_validate({"qk_norm_scope": "token"})
