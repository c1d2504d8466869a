"""Ulysses sequence parallelism on two gloo ranks gives the single-rank model's loss and gradients, and the
``fsdp_sp`` plugin with a replicated streaming dataset trains as one process does."""

from __future__ import annotations

import functools

import pytest
import torch

from smalti.llm import LLM

# (name, model options): RoPE with GQA split over ranks; ALiBi with one KV head (copied per query head) and
# QK-norm; learned positions with attention recomputed in backward; an MoE FFN.
CONFIGS = [
    ("rope-gqa", dict(position="rope", n_kv_heads=2, norm_type="rmsnorm", ffn_type="glu")),
    ("alibi-mqa", dict(position="alibi", n_kv_heads=1, qk_norm=True)),
    ("learned", dict(position="learned", activation_checkpointing={"granularity": "attention"})),
    # Routing is per token, so an MoE FFN on a chunk is exact; its balancing loss (statistics over the tokens
    # a rank sees) is per chunk under sp, so it is switched off for the comparison.
    ("moe", dict(position="rope", ffn_type="moe", moe={"num_experts": 4, "top_k": 2, "loss_weight": 0.0})),
]
SEQ, VOCAB = 16, 64


def _model(**kw) -> LLM:
    torch.manual_seed(0)
    return LLM(d_model=32, n_heads=4, n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ, tie_embeddings=False, **kw)


def _packed_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    # Three documents per row whose boundaries do not fall on the chunk boundary (position 8).
    sequence_id = torch.tensor([0] * 5 + [1] * 6 + [2] * 5).expand(3, SEQ).contiguous()
    labels = ids.clone()
    labels[:, :3] = -100  # an unequal number of targets per chunk
    return {"input_ids": ids, "sequence_id": sequence_id, "labels": labels}


def _mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


@pytest.mark.world_size(2)
def test_ulysses_two_ranks_match_one_rank(shared_tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from smalti.llm.model.sequence_parallel import SequenceParallelGroup

    group = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "sp")).get_group("sp")
    batch = _packed_batch()
    for name, options in CONFIGS:
        reference = _model(**options)
        expected = reference.loss(reference(batch), batch)
        expected.backward()

        model = _model(**options)
        model.enable_sequence_parallel(group)
        out = model(batch)
        assert out["logits"].shape == (3, SEQ // 2, VOCAB), name
        assert out["sequence_slice"] == (8 * dist.get_rank(), 8 * dist.get_rank() + 8, 2)
        loss = model.loss(out, batch)
        loss.backward()
        # Data parallelism averages loss and gradients over every rank; that average is the whole model's.
        torch.testing.assert_close(_mean_over_ranks(loss), expected.detach(), rtol=1e-5, atol=1e-6, msg=name)
        for pname, p in model.named_parameters():
            ref_grad = dict(reference.named_parameters())[pname].grad
            torch.testing.assert_close(_mean_over_ranks(p.grad), ref_grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=f"{name} {pname}": f"{n}: {m}")
        with torch.no_grad():  # eval forwards run whole sequences on every rank
            model.eval()
            torch.testing.assert_close(model(batch)["logits"], reference.eval()(batch)["logits"], rtol=1e-5,
                                       atol=1e-5)
    assert SequenceParallelGroup.from_group(group).chunk(SEQ) == (8 * dist.get_rank(), 8 * dist.get_rank() + 8)

    _trainer_with_replicated_streaming_data(shared_tmp_path)


def _trainer_with_replicated_streaming_data(root) -> None:
    """``fsdp_sp`` with ``sp=2`` on two ranks, data from MDS with ``replication=2``: both ranks see the same
    batches, the ones a single process reads, and training gives the single process's losses and weights."""
    import torch.distributed as dist

    from smalti.core import Callback, Trainer
    from smalti.core.data import build_dataloader
    from smalti.llm.data.mds import TextMDS
    from smalti.llm.data.prepare import prepare
    from smalti.llm.parallelism import SequenceParallelFSDP

    if dist.get_rank() == 0:
        prepare(["smalti-llm:finetune_tiny/train.jsonl"], str(root / "mds"), text_key="prompt", max_seq_len=SEQ,
                eval_fraction=0.1)
    dist.barrier()

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.batches: list[torch.Tensor] = []

        def on_batch_end(self, state) -> None:
            self.losses.append(float(state.batch_loss))
            self.batches.append(state.batch["input_ids"].clone())

    steps, batch_size = 3, 4
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2)
    parallelism = SequenceParallelFSDP(sp=2)
    assert (parallelism.dp_rank, parallelism.dp_world_size) == (0, 1)
    data = TextMDS(local=str(root / "mds"), split="train", max_seq_len=SEQ, shuffle=False, replication=2)
    loader = build_dataloader(data, batch_size, dp_rank=parallelism.dp_rank,
                              dp_world_size=parallelism.dp_world_size, shuffle=False)
    make = functools.partial(LLM, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=2048, max_seq_len=SEQ)
    torch.manual_seed(0)
    model = make()
    record = Record()
    trainer = Trainer(model, loader, f"{steps}ba", optimizers=optimizer, parallelism=parallelism,
                      callbacks={"record": record}, eval_interval=None)
    trainer.fit()
    assert model.sp is not None and model.sp.size == 2
    # the sp group read one batch between them: samples are counted once, tokens once
    assert trainer.state.timestamp.sample == steps * batch_size
    assert trainer.state.timestamp.token == steps * batch_size * SEQ

    single = TextMDS(local=str(root / "mds"), split="train", max_seq_len=SEQ, shuffle=False, rank=0, world_size=1)
    torch.manual_seed(0)
    reference = make()
    opt = optimizer(reference.parameters())
    losses = []
    ref_loader = torch.utils.data.DataLoader(single, batch_size=batch_size)
    for i, b in zip(range(steps), ref_loader):
        torch.testing.assert_close(record.batches[i], b["input_ids"])
        loss = reference.loss(reference(b), b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    gathered = [None, None]
    dist.all_gather_object(gathered, [t.tolist() for t in record.batches])
    assert gathered[0] == gathered[1]  # replication: the sp group read the same samples
    assert record.losses == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        # Adam magnifies float rounding in near-zero gradients; a wrong gradient moves weights by ~lr = 1e-2.
        torch.testing.assert_close(full, reference.state_dict()[name], rtol=1e-4, atol=1e-4)


def test_bad_sequence_parallel_settings_name_the_key():
    from smalti.core.errors import ConfigError
    from smalti.llm.errors import ModelConfigError
    from smalti.llm.model.sequence_parallel import SequenceParallelGroup
    from smalti.llm.parallelism import SequenceParallelFSDP

    with pytest.raises(ModelConfigError, match="n_heads=4"):
        _model().enable_sequence_parallel(SequenceParallelGroup(group=None, size=3, rank=0))
    with pytest.raises(ConfigError, match="parallelism.sp=0"):
        SequenceParallelFSDP(sp=0)
    with pytest.raises(ConfigError, match="sp=2 does not divide the world size 1"):
        SequenceParallelFSDP(sp=2).wrap(_model(), torch.device("cpu"), "fp32")
