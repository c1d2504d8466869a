"""Every shipped experiment composes with smalti-train's config and its components build."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from smalti.core.config.schema import register_configs

EXPERIMENTS = sorted(p.stem for p in Path(str(resources.files("smalti.llm") / "conf" / "experiment")).glob("*.yaml"))
BIG = {"mpt_125m", "mpt_350m", "mpt_1b", "mpt_7b", "llama3_8b"}
SIZES = {"mpt_125m": 125e6, "mpt_350m": 356e6, "mpt_1b": 1.316e9, "mpt_7b": 6.659e9, "llama3_8b": 8.03e9}


def _compose(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        return compose("train", overrides=overrides)


def test_all_recipes_are_shipped():
    assert set(EXPERIMENTS) >= {"gpt_tiny", "mpt_125m", "mpt_350m", "mpt_1b", "mpt_7b", "llama3_8b", "moe_tiny",
                                "moe_dbrx_like", "finetune_tiny"}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_builds(name, tmp_path):
    extra = []
    if name.startswith("finetune_hf"):  # the user gives the Hugging Face folder; a tiny one made by transformers here
        from smalti.testing.hf_models import write_tiny_hf_model

        extra = [f"model.pretrained={write_tiny_hf_model(tmp_path / 'hf', 'llama3')}", "model.init_device=cpu",
                 "model.max_seq_len=64"]
    cfg = _compose([f"experiment={name}", "logger=[]", *extra])
    # `callbacks=[]` switches off everything the run would have, the experiment's own callbacks included.
    assert dict(_compose([f"experiment={name}", "callbacks=[]", "logger=[]", *extra]).callbacks) == {}
    model = instantiate(cfg.model)
    assert model.max_seq_len == cfg.model.max_seq_len
    instantiate(cfg.optimizer)  # a factory; FSDP needs one
    callbacks = {name: instantiate(node) for name, node in cfg.callbacks.items()}
    assert type(callbacks["mlflow_model"]).__name__ == "MLflowModelRegistry"  # registers when logger=mlflow
    if name.startswith("finetune_hf"):  # hands back a Hugging Face folder at the end by default
        assert type(callbacks["hf_export"]).__name__ == "HFExport"
    if name == "finetune_hf_lora":  # PEFT's usual LoRA: r 16, alpha 32, dropout 0.05, every linear layer, lr 2e-4
        assert model.lora_config.targets == ("q", "k", "v", "o", "gate", "up", "down")
        assert (model.lora_config.r, model.lora_config.alpha, model.lora_config.dropout) == (16, 32, 0.05)
        assert cfg.optimizer.lr == 2e-4
    instantiate(cfg.scheduler)
    if name in BIG:
        # As shipped (no override), the big recipes build on the meta device: no memory until FSDP has sharded.
        assert cfg.model.init_device == "meta"
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
        assert abs(model.n_params - SIZES[name]) / SIZES[name] < 0.03, model.n_params
        # Foundry's recipe settings: gradient-norm clipping at 1.0 and FSDP mixed precision with bf16 params.
        from smalti.core.algorithms import GradientClipping
        from smalti.core.parallelism import FSDP

        algorithms = {key: instantiate(node) for key, node in cfg.algorithms.items()}
        clip = algorithms["gradient_clipping"]
        assert isinstance(clip, GradientClipping)
        assert (clip.clipping_type, clip.clipping_threshold) == ("norm", 1.0)
        parallelism = instantiate(cfg.parallelism)
        assert isinstance(parallelism, FSDP)
        assert parallelism.mp_policy.param_dtype == torch.bfloat16
        assert parallelism.mp_policy.reduce_dtype == torch.float32
        assert cfg.trainer.precision == "amp_bf16"
        assert cfg.data.train._target_.endswith("TextMDS")
        return
    train = instantiate(cfg.data.train)
    batch = torch.utils.data.default_collate([train[0], train[1]])
    out = model(batch)
    loss = model.loss(out, batch)
    assert torch.isfinite(loss)
    assert cfg.data.eval is None or len(instantiate(cfg.data.eval)) > 0


def test_sequence_parallel_option_replicates_streaming_data():
    from smalti.llm.parallelism import SequenceParallelFSDP

    cfg = _compose(["experiment=mpt_125m", "parallelism=fsdp_sp", "parallelism.sp=4", "callbacks=[]", "logger=[]"])
    parallelism = instantiate(cfg.parallelism)
    assert isinstance(parallelism, SequenceParallelFSDP) and parallelism.sp == 4
    assert cfg.data.train.replication == 4 and cfg.data.eval.replication == 4
    assert _compose(["experiment=mpt_125m", "callbacks=[]", "logger=[]"]).data.train.replication is None


@pytest.mark.parametrize("parallelism", ["single", "ddp", "fsdp", "fsdp_sp", "fsdp_ep"])
def test_big_recipes_take_another_parallelism_option(parallelism):
    """The bf16 mixed-precision policy lives in the recipe's parallelism option, so swapping the option (one GPU
    to debug, plain FSDP) builds instead of failing on keys the other option does not take."""
    cfg = _compose(["experiment=mpt_125m", f"parallelism={parallelism}", "callbacks=[]", "logger=[]"])
    built = instantiate(cfg.parallelism)
    assert type(built).__name__ == {"single": "SingleDevice", "ddp": "DDP", "fsdp": "FSDP",
                                     "fsdp_sp": "SequenceParallelFSDP", "fsdp_ep": "ExpertParallelFSDP"}[parallelism]
    assert "gradient_clipping" in cfg.algorithms


def test_meta_built_recipe_model_trains_after_the_trainer_allocates_it(tmp_path, monkeypatch):
    """mpt_125m's settings (meta init, gradient clipping) shrunk to a CPU size: the trainer allocates and
    initialises the meta model, and two steps train it."""
    from smalti.core.config.build import build_trainer

    monkeypatch.chdir(tmp_path)
    cfg = _compose(["experiment=mpt_125m", "parallelism=single", "data=corpus_tiny", "data.global_train_batch_size=4",
                    "model.d_model=64", "model.n_heads=4", "model.n_layers=2", "model.vocab_size=2048",
                    "model.max_seq_len=32", "trainer.precision=fp32", "trainer.max_duration=2ba",
                    "trainer.eval_interval=null", "trainer.device_train_microbatch_size=null", "callbacks=[]",
                    "logger=[]", "checkpoint=none"])
    trainer = build_trainer(cfg)
    try:
        model = trainer.state.raw_model
        assert not any(p.is_meta for p in model.parameters())
        assert 0.015 < float(model.wte.weight.detach().std()) < 0.025  # init_weights ran: normal(0, 0.02)
        state = trainer.fit()
    finally:
        trainer.close()
    assert state.timestamp.batch == 2 and torch.isfinite(torch.as_tensor(state.batch_loss))
