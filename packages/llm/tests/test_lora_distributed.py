"""LoRA under FSDP2 with Ulysses sequence parallelism (``parallelism=fsdp_sp``, ``sp=2``) on two gloo ranks trains
as one process does: the frozen bf16 base and the fp32 adapters sit in the same FSDP-wrapped blocks, the base
stays bit-identical and the adapters end within 1e-4 (relative) of the single process's."""

from __future__ import annotations

import functools

import pytest
import torch

from smalti.llm import LLM

SEQ, VOCAB, STEPS, BATCH = 16, 64, 3, 4
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "targets": "all_linear", "modules_to_save": ["lm_head"]}


def _model() -> LLM:
    torch.manual_seed(0)
    model = LLM(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ,
                tie_embeddings=False, ffn_type="glu", norm_type="rmsnorm", lora=LORA,
                activation_checkpointing={"granularity": "ffn", "layers": 1})
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B: a wrong adapter gradient or mapping would otherwise hide behind zeros
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        sequence_id = torch.tensor([0] * 5 + [1] * 6 + [2] * 5).expand(BATCH, SEQ).contiguous()
        out.append({"input_ids": ids, "sequence_id": sequence_id, "labels": ids.clone()})
    return out


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


@pytest.mark.world_size(2)
def test_lora_under_fsdp_and_sp2_matches_one_process():
    import torch.distributed as dist

    from smalti.core import Callback, Trainer
    from smalti.llm.lora.layer import LoRALinear
    from smalti.llm.lora.naming import clean_name
    from smalti.llm.parallelism import SequenceParallelFSDP

    batches = _batches()
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2)

    reference = _model()
    opt = optimizer([p for p in reference.parameters() if p.requires_grad])
    losses, first_grads = [], {}
    for batch in batches:
        loss = reference.loss(reference(batch), batch)
        opt.zero_grad()
        loss.backward()
        first_grads = first_grads or {n: p.grad.clone() for n, p in reference.named_parameters() if p.requires_grad}
        opt.step()
        losses.append(loss.item())

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.grads: dict[str, torch.Tensor] = {}

        def on_before_optimizer_step(self, state) -> None:
            if not self.grads:  # collective (full_tensor all-gathers the shards): every rank records
                self.grads = {clean_name(n): _full(p.grad).clone() for n, p in state.model.named_parameters()
                              if p.grad is not None}

        def on_batch_end(self, state) -> None:
            self.losses.append(float(state.batch_loss))

    model = _model()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    record = Record()
    trainer = Trainer(model, batches, f"{STEPS}ba", optimizers=optimizer, parallelism=SequenceParallelFSDP(sp=2),
                      callbacks={"record": record}, eval_interval=None)
    trainer.fit()
    assert model.sp is not None and model.sp.size == 2 and dist.get_world_size() == 2
    # frozen and trainable parameters were sharded in the same FSDP-wrapped blocks
    wqkv = model.blocks[0].attn.wqkv
    assert isinstance(wqkv, LoRALinear) and hasattr(wqkv.weight, "full_tensor")
    assert hasattr(wqkv.lora_A["q"], "full_tensor") and not wqkv.weight.requires_grad
    (opt_,) = trainer.state.optimizers
    assert sum(1 for g in opt_.param_groups for p in g["params"]) == len(start) - len(frozen) - 1  # no fingerprint
    assert record.losses == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert sorted(record.grads) == sorted(first_grads)  # only the adapters and lm_head got gradients
    for name, want in first_grads.items():
        assert (record.grads[name] - want).norm() <= 1e-4 * want.norm(), name
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        full = _full(value).detach()
        if name in frozen:
            assert torch.equal(full, start[name]), name
        # Adam turns float rounding in a near-zero gradient into a step of up to lr (1e-2) on that element; a wrong
        # gradient moves whole tensors by ~lr.
        want = expected[name].float()
        assert (full.float() - want).norm() <= 1e-3 * want.norm() + 1e-6, name
