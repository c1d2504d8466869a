"""The speed and memory defaults measured by bench/llm_vs_hf.py are what the recipes run, and stay exact.

The fused chunked loss is the model's default and fused AdamW the ``optimizer=adamw`` default; both must be on
for ``experiment=finetune_hf`` and the MPT / Llama 3 recipes, and train under FSDP2 exactly as one process does;
the pretraining recipes run at ``precision=amp_bf16``.
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from smalti.core.config.schema import register_configs
from smalti.llm import LLM
from smalti.llm.data.synthetic import MarkovTokens

STEPS = 3


def _compose(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        return compose("train", overrides=overrides)


@pytest.mark.parametrize("experiment", [None, "gpt_tiny", "finetune_hf", "mpt_125m", "mpt_1b", "mpt_7b", "llama3_8b"])
def test_recipes_train_with_fused_adamw_and_the_fused_loss(experiment):
    cfg = _compose([f"experiment={experiment}"] if experiment else [])
    assert cfg.optimizer._target_ in ("torch.optim.AdamW", "smalti.core.optim.DecoupledAdamW")
    assert cfg.optimizer.fused is True, f"experiment={experiment} runs the per-tensor AdamW loop"
    assert cfg.model.get("fused_loss", True) is True, f"experiment={experiment} materialises the logits"


@pytest.mark.parametrize("experiment", ["finetune_hf", "mpt_125m", "mpt_1b", "mpt_7b", "llama3_8b"])
def test_recipes_run_the_matrix_products_in_bf16_with_fp32_weights(experiment):
    """amp_bf16 (fp32 master weights and AdamW state, bf16 autocast), as LLM Foundry's recipes."""
    assert _compose([f"experiment={experiment}"]).trainer.precision == "amp_bf16"


def _model() -> LLM:
    torch.manual_seed(0)
    return LLM(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=64, max_seq_len=16, norm_type="rmsnorm",
               ffn_type="glu", tie_embeddings=False)


@pytest.mark.world_size(2)
def test_default_optimizer_under_fsdp2_trains_like_one_process():
    """``optimizer=adamw`` as composed (fused) over FSDP2's DTensor shards, with the fused loss, gives the
    losses and weights of one process training the whole batch with the same optimizer."""
    import torch.distributed as dist

    from smalti.core import Callback, Trainer
    from smalti.core.data import build_dataloader
    from smalti.core.parallelism import FSDP

    make_opt = instantiate(_compose([])["optimizer"], lr=1e-2)
    assert make_opt.keywords["fused"] is True
    data = MarkovTokens(vocab_size=64, max_seq_len=16, num_samples=64, seed=1)

    ref = _model()
    opt = make_opt(ref.parameters())
    expected = []
    for _, batch in zip(range(STEPS), torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)):
        loss = ref.loss(ref(batch), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())

    class Losses(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_batch_end(self, state, logger) -> None:
            self.values.append(float(state.batch_loss))

    rank, world = dist.get_rank(), dist.get_world_size()
    recorder = Losses()
    model = _model()
    loader = build_dataloader(data, 8 // world, dp_rank=rank, dp_world_size=world, shuffle=False)
    trainer = Trainer(model, loader, f"{STEPS}ba", optimizers=make_opt, parallelism=FSDP(),
                      callbacks={"losses": recorder}, eval_interval=None)
    assert trainer.state.optimizers[0].defaults["fused"] is True
    trainer.fit()
    assert recorder.values == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # Adam divides by sqrt(v): a near-zero gradient summed in another order moves its weight by up to ~lr * 1e-2
    # (1e-4 here, against the lr * steps = 3e-2 every weight may move).
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        torch.testing.assert_close(full, ref.state_dict()[name], rtol=1e-4, atol=1e-4)


def test_attention_runs_in_fp32_under_cpu_autocast(monkeypatch):
    """Under CPU bf16 autocast the projections are bf16 but attention itself gets fp32 inputs: PyTorch's CPU bf16
    attention kernel alone moved a Llama's first loss 1.4e-4 from transformers' fp32 one (bench/llm_vs_hf.py)."""
    import smalti.llm.model.attention as attention

    seen: list[torch.dtype] = []
    real = attention.attend

    def spy(q, k, v, *args, **kwargs):
        seen.append(q.dtype)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "attend", spy)
    model = _model()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model({"input_ids": ids})["logits"]
    assert seen and set(seen) == {torch.float32}
    assert logits.dtype == torch.bfloat16  # the head's matrix product still ran in bf16
