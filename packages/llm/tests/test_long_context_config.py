"""The Llama 3 8B recipe and ``experiment=finetune_hf`` reach 131,072 tokens with ``parallelism=fsdp_sp`` by
configuration alone: the model, the data and the sequence-parallel plugin all take the length from
``model.max_seq_len``."""

from __future__ import annotations

import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from smalti.core.config.schema import register_configs

LONG = 131072


def _compose(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        return compose("train", overrides=overrides)


def test_llama3_8b_recipe_takes_131072_tokens_with_fsdp_sp():
    from smalti.llm.parallelism import SequenceParallelFSDP

    cfg = _compose(["experiment=llama3_8b", "parallelism=fsdp_sp", "parallelism.sp=8", f"model.max_seq_len={LONG}",
                    "callbacks=[]", "logger=[]"])
    assert cfg.data.train.max_seq_len == LONG and cfg.data.train.replication == 8
    parallelism = instantiate(cfg.parallelism)
    assert isinstance(parallelism, SequenceParallelFSDP) and parallelism.sp == 8
    model = instantiate(cfg.model, n_layers=2)  # on the meta device: no memory; 2 of the 32 layers suffice here
    assert model.max_seq_len == LONG
    assert model.fused_loss  # no [B, T, vocab] logits at 131K
    # Llama 3.1's RoPE scaling (the one Meta trained to 131,072 positions) and every block recomputed in backward
    assert model.config["rope_scaling"]["type"] == "llama3" and model.config["rope_scaling"]["factor"] == 8.0
    assert cfg.model.n_layers == 32 and all(block.checkpointing == "block" for block in model.blocks)
    assert model.n_heads % 8 == 0  # sp=8 splits the 32 heads; the 8 KV heads too


def test_finetune_hf_takes_131072_tokens_with_fsdp_sp(tmp_path):
    from smalti.testing.hf_models import write_tiny_hf_model

    folder = write_tiny_hf_model(tmp_path / "hf", "llama3")
    cfg = _compose(["experiment=finetune_hf", f"model.pretrained={folder}", "model.init_device=cpu",
                    f"model.max_seq_len={LONG}", "parallelism=fsdp_sp", "parallelism.sp=2", "callbacks=[]",
                    "logger=[]"])
    assert cfg.data.train.max_seq_len == LONG and cfg.data.train.packing
    model = instantiate(cfg.model)
    assert model.max_seq_len == LONG and model.attn_uses_sequence_id
    # A packed training row longer than the folder's max_position_embeddings (256) trains.
    seq_len = 1024
    batch = {"input_ids": torch.randint(0, 512, (1, seq_len), generator=torch.Generator().manual_seed(0)),
             "sequence_id": torch.repeat_interleave(torch.arange(3), torch.tensor([300, 500, 224]))[None]}
    model.train()
    out = model(batch)
    assert "logits" not in out  # the fused loss scored the targets
    model.loss(out, batch).backward()
    assert all(p.grad is not None for p in model.parameters())
