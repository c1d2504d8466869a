"""LoRA on each expert under ``parallelism=fsdp_ep``: a tiny Mixtral written by transformers, its experts split over
two gloo ranks (ep=2) and everything else FSDP2-sharded over both, trains adapters on attention and on every expert
as one process holding both ranks' batches does (losses within 1e-4 relative), only the adapters train, and the
``hf_export`` callback gathers the sharded expert adapters into the one-process PEFT folder (within 1e-5)."""

from __future__ import annotations

import functools
import time

import pytest
import torch

SEQ, STEPS, BATCH = 12, 3, 2
LORA = {"r": 2, "alpha": 4, "dropout": 0.0, "base_dtype": "float32", "targets": ["q", "v", "experts"]}


def _samples(vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, vocab, (SEQ,), generator=gen)} for _ in range(2 * STEPS * BATCH)]


def _write_model_and_start_adapter(folder, start) -> None:
    """The Mixtral and a PEFT adapter with non-zero B and different values per expert, which both runs start from
    (an adapter initialised on sharded parameters would draw other random numbers than one process)."""
    from smalti.llm.hf import import_hf
    from smalti.llm.lora import save_adapter
    from smalti.testing.hf_models import write_tiny_hf_model

    # no balancing loss: it is a statistic of the tokens one rank sees (see test_expert_parallel_fsdp.py)
    write_tiny_hf_model(folder, "mixtral", output_router_logits=False)
    model = import_hf(folder, lora=LORA)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    save_adapter(model, start)


@pytest.mark.timeout(1200)
@pytest.mark.world_size(2, timeout=1100)  # two ranks import transformers and train on a loaded 2-core CI
def test_expert_lora_at_ep2_trains_and_saves_as_one_process(shared_tmp_path, one_process_losses):
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    from smalti.core import Callback, Trainer
    from smalti.core.data import build_dataloader
    from smalti.llm.hf import HFExport, PretrainedLLM, import_hf
    from smalti.llm.lora import save_adapter
    from smalti.llm.lora.experts import LoRAExperts
    from smalti.llm.parallelism import ExpertParallelFSDP

    rank = dist.get_rank()
    folder, start, written = shared_tmp_path / "mixtral", shared_tmp_path / "start", shared_tmp_path / "written"
    if rank == 0:  # the other rank polls: a gloo barrier gives up before transformers is imported on a loaded CI
        _write_model_and_start_adapter(folder, start)
        written.touch()
    deadline = time.monotonic() + 600
    while not written.exists():
        assert time.monotonic() < deadline, "rank 0 did not write the model within 600 s"
        time.sleep(0.2)
    lora = {**LORA, "init_from": str(start)}

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_batch_end(self, state) -> None:
            self.losses.append(float(state.batch_loss))

    # SGD, not Adam: Adam's step hides a gradient off by a constant factor (such as a missing 1 / ep)
    optimizer = functools.partial(torch.optim.SGD, lr=0.5)
    model = PretrainedLLM(folder, require_tokenizer=False, lora=lora)
    samples = _samples(model.config["vocab_size"])
    loader = build_dataloader(samples, BATCH, dp_rank=rank, dp_world_size=2, shuffle=False)
    record, export = Record(), HFExport(folder=str(shared_tmp_path / "out" / "hf"), merge=False)
    trainer = Trainer(model, loader, f"{STEPS}ba", optimizers=optimizer, parallelism=ExpertParallelFSDP(ep=2),
                      callbacks={"record": record, "hf_export": export}, eval_interval=None, progress_bar=False,
                      loggers=[])
    layers = [block.ffn.moe for block in model.blocks]
    assert all(isinstance(m, LoRAExperts) and m.num_local_experts == 2 for m in layers)
    adapter_a = layers[0].adapters.lora_A["w1"]
    assert isinstance(adapter_a, DTensor) and adapter_a.to_local().shape[0] < adapter_a.shape[0]  # sharded
    base = {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer.fit()
    (opt,) = trainer.state.optimizers
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert trained == {id(p) for n, p in model.named_parameters() if "lora_" in n}  # only the adapters
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.full_tensor(), base[name]), name
    gathered: list = [None, None]
    dist.all_gather_object(gathered, record.losses)
    trainer.close()
    if rank:
        return

    reference = import_hf(folder, lora=lora)
    opt = optimizer([p for p in reference.parameters() if p.requires_grad])
    expected = one_process_losses(reference, opt, samples, STEPS, BATCH)
    mean = [(a + b) / 2 for a, b in zip(*gathered, strict=True)]
    assert mean == pytest.approx(expected, rel=1e-4)
    assert expected[-1] < expected[0] - 1e-3  # the adapters learned something
    theirs = load_file(str(save_adapter(reference, shared_tmp_path / "reference") / "adapter_model.safetensors"))
    ours = load_file(str(shared_tmp_path / "out" / "adapter" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs) and any(".mlp.experts." in k for k in ours)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    assert not torch.equal(ours[key], load_file(str(start / "adapter_model.safetensors"))[key])  # it trained
