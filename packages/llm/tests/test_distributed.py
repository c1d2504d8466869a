"""Two gloo ranks with FSDP2 train the LLM exactly as one process does on the whole batch."""

from __future__ import annotations

import functools

import pytest
import torch

from smalti.llm import LLM
from smalti.llm.data.synthetic import MarkovTokens

STEPS = 3


def _model() -> LLM:
    torch.manual_seed(0)
    return LLM(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=32, max_seq_len=16, position="alibi",
               activation_checkpointing={"granularity": "ffn", "layers": 1})


def _reference(data, global_batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    loader = torch.utils.data.DataLoader(data, batch_size=global_batch, shuffle=False)
    for _, batch in zip(range(STEPS), loader):
        loss = model.loss(model(batch), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.world_size(2)
def test_fsdp_two_ranks_match_one_rank():
    import torch.distributed as dist

    from smalti.core import Callback, Trainer
    from smalti.core.data import build_dataloader
    from smalti.core.parallelism import FSDP

    class Losses(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_batch_end(self, state, logger) -> None:
            self.values.append(float(state.batch_loss))

    data = MarkovTokens(vocab_size=32, max_seq_len=16, num_samples=64, seed=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    expected_losses, expected_weights = _reference(data, 8)
    recorder = Losses()
    loader = build_dataloader(data, 8 // world, dp_rank=rank, dp_world_size=world, shuffle=False)
    model = _model()
    Trainer(model, loader, f"{STEPS}ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
            parallelism=FSDP(), callbacks={"losses": recorder}, eval_interval=None).fit()
    assert recorder.values == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        torch.testing.assert_close(full, expected_weights[name], rtol=1e-4, atol=1e-5)

    # What the MLflow registry exports: the whole model gathered from the shards (collective), on rank 0.
    from smalti.llm.model.copies import full_state_dict, plain_copy

    gathered = full_state_dict(model)
    if rank == 0:
        copy = plain_copy(model, gathered)
        for name, value in copy.state_dict().items():
            torch.testing.assert_close(value, expected_weights[name], rtol=1e-4, atol=1e-5)
