"""Checkpoint and resume of an expert-parallel run (smalti-llm ``parallelism=fsdp_ep`` + smalti-checkpoint): a
tiny Mixtral trained on two gloo ranks with its experts split over them (ep=2) is saved with DCP after 2 of its
4 batches; resuming it with the same layout gives the uninterrupted run's losses and weights bit for bit, and
resuming it with the experts whole on every rank (ep=1, FSDP2 over both ranks) gives them within 1e-4 relative:
DCP reshards the experts' ``Shard(0)`` tensors and their optimizer state to the new layout."""

from __future__ import annotations

import functools
import time

import pytest

pytest.importorskip("smalti.checkpoint")

import torch  # noqa: E402

SEQ, STEPS, SAVED_AT, BATCH = 12, 4, 2, 2


def _samples(vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, vocab, (SEQ,), generator=gen)} for _ in range(2 * STEPS * BATCH)]


def _run(folder, ep: int, duration: str, **checkpoint):
    """Train the Mixtral in ``folder`` with ``ep`` expert-parallel ranks; returns (losses, whole weights)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from smalti.checkpoint import Checkpointer
    from smalti.core import Callback, Trainer
    from smalti.core.data import build_dataloader
    from smalti.llm.hf import PretrainedLLM
    from smalti.llm.parallelism import ExpertParallelFSDP

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_batch_end(self, state) -> None:
            self.losses.append(float(state.batch_loss))

    model = PretrainedLLM(folder, require_tokenizer=False)
    loader = build_dataloader(_samples(model.config["vocab_size"]), BATCH, dp_rank=dist.get_rank(),
                              dp_world_size=2, shuffle=False)
    record = Record()
    trainer = Trainer(model, loader, duration, optimizers=functools.partial(torch.optim.AdamW, lr=1e-3),
                      parallelism=ExpertParallelFSDP(ep=ep), eval_interval=None, run_name=f"ep{ep}-{duration}",
                      progress_bar=False, loggers=[],
                      callbacks={"record": record, "checkpoint": Checkpointer(save_on_fit_end=False, **checkpoint)})
    trainer.fit()
    weights = {n: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
               for n, v in model.state_dict().items()}
    trainer.close()
    gathered: list = [None, None]
    dist.all_gather_object(gathered, record.losses)
    return [(a + b) / 2 for a, b in zip(*gathered, strict=True)], weights


@pytest.mark.timeout(1200)
@pytest.mark.world_size(2, timeout=1100)  # three short runs of two ranks on a loaded 2-core CI
def test_ep2_checkpoint_resumes_bit_identical_and_on_ep1(shared_tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from smalti.testing.hf_models import write_tiny_hf_model

    # rank 0 writes the model (transformers' save_pretrained writes config.json on rank 0 only) while rank 1
    # watches for it: a gloo barrier gives up after 60 s, which importing transformers alone can take on a loaded
    # machine. No balancing loss: it is a statistic of one rank's tokens (see the llm fsdp_ep test).
    folder, written = shared_tmp_path / "mixtral", shared_tmp_path / "mixtral.written"
    if dist.get_rank() == 0:
        write_tiny_hf_model(folder, "mixtral", output_router_logits=False)
        written.touch()
    deadline = time.monotonic() + 600
    while not written.exists():
        assert time.monotonic() < deadline, "rank 0 did not write the model within 600 s"
        time.sleep(0.2)
    saved = shared_tmp_path / "ckpt"

    # the uninterrupted run, saving after SAVED_AT batches on the way
    whole, expected = _run(folder, 2, f"{STEPS}ba", save_folder=str(saved), save_interval=f"{SAVED_AT}ba")
    checkpoint = saved / f"ep0-ba{SAVED_AT}"
    assert (checkpoint / "manifest.json").is_file()

    # the checkpoint holds each rank's experts as shards of the whole stack
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    experts = [k for k in metadata if k.endswith(".ffn.moe.w1") and k.startswith("model.")]
    assert experts and all(len(metadata[k].chunks) == 2 for k in experts), experts

    resumed, weights = _run(folder, 2, f"{STEPS}ba", load_path=str(checkpoint), save_interval=None)
    assert resumed == whole[SAVED_AT:]  # bit-identical: same layout, same reduction order
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name

    relaid, weights = _run(folder, 1, f"{STEPS}ba", load_path=str(checkpoint), save_interval=None)
    assert relaid == pytest.approx(whole[SAVED_AT:], rel=1e-4)
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert not any(isinstance(v, DTensor) and v.device_mesh.ndim > 1 for v in weights.values())
