"""Two gloo ranks on CPU: ddp, fsdp and hsdp follow the single-process loss trajectory at the same global batch.

Tolerance: the ranks average gradients with an all-reduce / reduce-scatter, which sums in another order
than one process's batch mean, so values differ by float32 rounding (~1e-7 relative per step); Adam
amplifies that a little over 12 steps, hence rtol=1e-4. A real bug (wrong scaling, a skipped sync, a
different data order) moves the loss by percents.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

from smalti.core.errors import DistributedError
from smalti.testing.pytest_plugin import IN_RANK_ENV


def train_single_process(output_dir):
    """The reference: one process, no process group, the global batch of 32 the two ranks split."""
    import functools

    from smalti.core import Callback, Trainer
    from smalti.core.data import build_dataloader
    from smalti.core.examples import MLPRegressor, SyntheticRegression

    losses = []

    class Rec(Callback):
        def on_batch_end(self, state):
            losses.append(float(state.batch_loss))

    torch.manual_seed(0)
    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(256), 32, seed=5), "12ba",
            optimizers=functools.partial(torch.optim.AdamW, lr=1e-2), callbacks=[Rec()],
            output_dir=str(output_dir)).fit()
    return losses


@pytest.fixture(scope="module")
def _single_process_run(tmp_path_factory):
    """Trained once per module, in the pytest process that launches the ranks (no process group there)."""
    if os.environ.get(IN_RANK_ENV):
        return None
    return train_single_process(tmp_path_factory.mktemp("single"))


@pytest.fixture
def reference_losses(shared_tmp_path, _single_process_run):
    """The single-process losses: the launching process hands them to the ranks through the shared folder."""
    path = shared_tmp_path / "single.json"
    if _single_process_run is not None:
        path.write_text(json.dumps(_single_process_run))
        return _single_process_run
    return json.loads(path.read_text())


def distributed_losses(parallelism, micro=None, callbacks=()):
    import functools

    from smalti.core import Callback, Trainer
    from smalti.core.data import build_dataloader
    from smalti.core.examples import MLPRegressor, SyntheticRegression

    losses = []

    class Rec(Callback):
        def on_batch_end(self, state):
            losses.append(float(state.batch_loss))

    loader = build_dataloader(SyntheticRegression(256), 16, dp_rank=dist.get_rank(), dp_world_size=2, seed=5)
    torch.manual_seed(0)
    trainer = Trainer(MLPRegressor(), loader, "12ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                      callbacks=[Rec(), *callbacks], parallelism=parallelism, device_train_microbatch_size=micro)
    trainer.fit()
    return losses, trainer


@pytest.mark.world_size(2)
def test_ddp_allocates_a_meta_built_model_before_wrapping():
    """DDP keeps whole replicas: a meta-built model is filled before wrapping and rank 0's weights win."""
    import functools

    from smalti.core import Trainer
    from smalti.core.data import build_dataloader
    from smalti.core.examples import MLPRegressor, SyntheticRegression
    from smalti.core.parallelism import DDP

    with torch.device("meta"):
        model = MLPRegressor()
    torch.manual_seed(dist.get_rank())  # each rank would draw other weights
    loader = build_dataloader(SyntheticRegression(64), 16, dp_rank=dist.get_rank(), dp_world_size=2)
    trainer = Trainer(model, loader, "3ba", optimizers=functools.partial(torch.optim.SGD, lr=1e-2),
                      parallelism=DDP())
    trainer.fit()
    flat = torch.cat([p.detach().flatten() for p in trainer.state.raw_model.parameters()])
    assert not any(p.is_meta for p in trainer.state.raw_model.parameters())
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0)
    assert torch.isfinite(trainer.state.batch_loss)


@pytest.mark.world_size(2)
def test_ddp_matches_single_process(reference_losses):
    from smalti.core.parallelism import DDP

    losses, trainer = distributed_losses(DDP(), micro=8)
    assert trainer.state.world_size == 2 and trainer.state.timestamp.sample == 12 * 32
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-4, atol=1e-6)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.world_size(2)
def test_fsdp_matches_single_process(reference_losses):
    from torch.distributed.tensor import DTensor

    from smalti.core.parallelism import FSDP

    losses, trainer = distributed_losses(FSDP())
    assert all(isinstance(p, DTensor) for p in trainer.state.model.parameters())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-4, atol=1e-6)


@pytest.mark.world_size(2)
def test_fsdp_accumulation_reduce_scatters_each_micro_batch_with_the_same_losses(reference_losses):
    """4 micro batches per rank: sharded accumulation (the default, torchtitan's) and one reduce-scatter per step
    (unsharded gradients between micro batches) both follow the single process; only the first has gradients in
    the parameters' shards after the first micro batch (each micro batch was reduce-scattered at once)."""
    from smalti.core import Callback
    from smalti.core.parallelism import FSDP

    class ShardedGradsAfterFirstMicrobatch(Callback):
        def __init__(self):
            self.seen = []

        def on_microbatch_end(self, state):
            if state.timestamp.batch == 0 and state.microbatch_idx == 0:
                grads = [p.grad for p in state.model.parameters()]
                self.seen = [g is not None and g.to_local().shape == p.to_local().shape
                             for g, p in zip(grads, state.model.parameters())]

    runs = {}
    for every in (True, False):
        probe = ShardedGradsAfterFirstMicrobatch()
        losses, trainer = distributed_losses(FSDP(reduce_every_microbatch=every), micro=4, callbacks=[probe])
        assert trainer.state.num_microbatches == 4
        runs[every] = losses
        assert all(probe.seen) if every else not any(probe.seen), (every, probe.seen)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(runs[True]), torch.tensor(runs[False]), rtol=1e-5, atol=1e-7)


@pytest.mark.world_size(2)
def test_hsdp_matches_single_process(reference_losses):
    from smalti.core.parallelism import HSDP

    parallelism = HSDP(replicate=2, shard=1)
    losses, trainer = distributed_losses(parallelism)
    assert trainer.state.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert tuple(trainer.state.device_mesh.shape) == (2, 1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-4, atol=1e-6)


@pytest.mark.world_size(2)
def test_ranks_with_different_configs_fail_naming_the_key():
    from smalti.core.distributed import check_same_config

    check_same_config({"optimizer": {"lr": 0.1}, "run_name": "x"})
    with pytest.raises(DistributedError, match=r"optimizer\.lr"):
        check_same_config({"optimizer": {"lr": 0.1 * (dist.get_rank() + 1)}, "run_name": "x"})
