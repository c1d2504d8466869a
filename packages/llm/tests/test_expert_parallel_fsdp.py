"""``parallelism=fsdp_ep``: a tiny Mixtral written by transformers, trained on two gloo ranks with its experts split
over them (ep=2) and everything else FSDP2-sharded over both, gives one process's losses and weights; each rank
reads only its own experts' rows from the safetensors."""

from __future__ import annotations

import functools

import pytest
import torch

SEQ, STEPS, BATCH = 12, 3, 2


def _samples(vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, vocab, (SEQ,), generator=gen)} for _ in range(2 * STEPS * BATCH)]


@pytest.mark.world_size(2, timeout=600)  # two ranks import transformers and train on a loaded 2-core CI
def test_ep2_with_fsdp_gives_one_process_losses(shared_tmp_path, one_process_losses):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from smalti.core import Callback, Trainer
    from smalti.core.data import build_dataloader
    from smalti.llm.hf import PretrainedLLM, import_hf
    from smalti.llm.parallelism import ExpertParallelFSDP
    from smalti.moe import MoE
    from smalti.testing.hf_models import write_tiny_hf_model

    rank = dist.get_rank()
    folder = shared_tmp_path / "mixtral"
    if rank == 0:
        # Without the balancing loss: it is a statistic of the tokens one rank sees, so the mean over ranks of
        # per-rank losses is not the loss of one process holding every token (as under plain data parallelism).
        write_tiny_hf_model(folder, "mixtral", output_router_logits=False)
    dist.barrier()

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_batch_end(self, state) -> None:
            self.losses.append(float(state.batch_loss))

    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    model = PretrainedLLM(folder, require_tokenizer=False)
    samples = _samples(model.config["vocab_size"])
    parallelism = ExpertParallelFSDP(ep=2)
    loader = build_dataloader(samples, BATCH, dp_rank=rank, dp_world_size=2, shuffle=False)
    record = Record()
    trainer = Trainer(model, loader, f"{STEPS}ba", optimizers=optimizer, parallelism=parallelism,
                      callbacks={"record": record}, eval_interval=None)

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and all(m.num_local_experts == 2 for m in layers)
    reference = import_hf(folder)
    ref_layers = [m for m in reference.modules() if isinstance(m, MoE)]
    for ours, theirs in zip(layers, ref_layers, strict=True):
        # This rank's experts came from the files: rows 2r, 2r+1 of the whole stack, nothing else.
        assert isinstance(ours.w1, DTensor) and ours.w1.shape == theirs.w1.shape
        torch.testing.assert_close(ours.w1.full_tensor(), theirs.w1.detach())
        local = ours.w1.to_local()
        assert local.shape[0] <= 2
        assert ours.expert_group is not None and dist.get_world_size(ours.expert_group) == 2
    trainer.fit()

    expected = one_process_losses(reference, optimizer(reference.parameters()), samples, STEPS, BATCH)
    gathered = [None, None]
    dist.all_gather_object(gathered, record.losses)
    mean = [(a + b) / 2 for a, b in zip(*gathered, strict=True)]
    assert mean == pytest.approx(expected, rel=1e-4)
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        torch.testing.assert_close(full, reference.state_dict()[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_bad_ep_is_refused_naming_it():
    from smalti.core.errors import ConfigError
    from smalti.llm.parallelism import ExpertParallelFSDP

    with pytest.raises(ConfigError, match=r"parallelism.ep=0"):
        ExpertParallelFSDP(ep=0)
