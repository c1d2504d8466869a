"""``model=hf`` trains no longer than the folder's model was trained on unless asked, and says so when asked:
``max_seq_len`` defaults to ``min(2048, max_position_embeddings)``; a longer one warns, naming the RoPE scaling."""

from __future__ import annotations

import logging

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from smalti.core.config.schema import register_configs
from smalti.testing.hf_models import write_tiny_hf_model  # noqa: E402


def _compose(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        return compose("train", overrides=["experiment=finetune_hf", "callbacks=[]", "logger=[]", *overrides])


@pytest.mark.parametrize(("positions", "expected"), [(256, 256), (4096, 2048)])
def test_default_is_the_smaller_of_2048_and_the_trained_positions(tmp_path, positions, expected, caplog):
    folder = write_tiny_hf_model(tmp_path / "qwen2", "qwen2", max_position_embeddings=positions)
    cfg = _compose([f"model.pretrained={folder}"])
    assert cfg.model.max_seq_len == expected
    assert cfg.data.train.max_seq_len == expected  # the chat rows have the model's length
    with caplog.at_level(logging.WARNING, logger="smalti.llm"):
        assert instantiate(cfg.model).max_seq_len == expected
    assert "max_position_embeddings" not in caplog.text


@pytest.mark.parametrize(("family", "says"), [
    ("qwen2", "applies no RoPE scaling"),
    ("llama3", "applies RoPE scaling 'llama3' (factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0, "
               "original_max_position_embeddings=32)"),
])
def test_a_longer_sequence_warns_and_names_the_rope_scaling(tmp_path, caplog, family, says):
    folder = write_tiny_hf_model(tmp_path / family, family)  # max_position_embeddings=256
    cfg = _compose([f"model.pretrained={folder}", "model.max_seq_len=1024"])
    with caplog.at_level(logging.WARNING, logger="smalti.llm"):
        model = instantiate(cfg.model)
    assert model.max_seq_len == 1024  # allowed: long-context finetuning is a choice
    (record,) = [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    message = record.getMessage()
    assert "model.max_seq_len=1024 is longer than max_position_embeddings=256" in message
    assert str(folder / "config.json") in message and says in message
