"""Two gloo ranks: FSDP save -> load into one process and into HSDP; one process -> FSDP; HSDP writes once."""

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from smalti.checkpoint import Checkpointer, ReshardError
from smalti.testing.hostile_checkpoints import RunsCode

SINGLE = """
import functools, sys, torch
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.checkpoint import Checkpointer, ReshardError
from torch.distributed.checkpoint.state_dict import get_state_dict
load, save, dump = sys.argv[1:4]
torch.manual_seed(0)
t = Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(256), 32, seed=5), "6ba",
            optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
            callbacks={"checkpoint": Checkpointer(save, save_interval=None, load_path=load)})
model_sd, optim_sd = get_state_dict(t.state.model, t.state.optimizers)
torch.save({"model": model_sd, "optim": optim_sd, "batch": t.state.timestamp.batch}, dump + ".loaded")
t.fit()
model_sd, optim_sd = get_state_dict(t.state.model, t.state.optimizers)
torch.save({"model": model_sd, "optim": optim_sd, "batch": t.state.timestamp.batch}, dump + ".final")
"""


SUPPORT = str(Path(__file__).parent / "support")
STATEFUL_SAVE = """
import functools, sys, torch
from smalti.core import Trainer
from smalti.core.examples import MLPRegressor
from smalti.checkpoint import Checkpointer
from stateful_loader import PositionLoader
torch.manual_seed(0)
Trainer(MLPRegressor(), PositionLoader(), "3ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
        callbacks={"checkpoint": Checkpointer(sys.argv[1], save_interval="3ba")}).fit()
"""


def make_trainer(parallelism, duration, checkpointer, callbacks=None):
    from smalti.core import Trainer
    from smalti.core.data import build_dataloader
    from smalti.core.examples import MLPRegressor, SyntheticRegression

    loader = build_dataloader(SyntheticRegression(256), 16, dp_rank=dist.get_rank(), dp_world_size=2, seed=5)
    torch.manual_seed(0)
    return Trainer(MLPRegressor(), loader, duration, optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                   parallelism=parallelism, callbacks={**(callbacks or {}), "checkpoint": checkpointer})


def full_state(trainer):
    model_sd, optim_sd = get_state_dict(trainer.state.model, trainer.state.optimizers,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_sd, "optim": optim_sd}  # full on rank 0 only (cpu_offload)


def assert_nested_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_nested_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def run_single_process(load, save, dump, script=SINGLE):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                               "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([SUPPORT, *sys.path])
    out = subprocess.run([sys.executable, "-c", script, load, save, dump], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.world_size(2)
def test_fsdp_checkpoint_reshards_to_one_process_and_back(shared_tmp_path):
    from smalti.core.parallelism import FSDP

    fsdp_dir, single_dir, dump = shared_tmp_path / "fsdp", shared_tmp_path / "single", str(shared_tmp_path / "dump")
    trainer = make_trainer(FSDP(), "4ba", Checkpointer(str(fsdp_dir), save_interval="4ba"))
    trainer.fit()
    saved = full_state(trainer)
    manifest = json.loads((fsdp_dir / "ep0-ba4" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["mesh_shape"] == [2] and manifest["writer_ranks"] == [0, 1]
    assert {"__0_0.distcp", "__1_0.distcp", "extra/rank0.pt", "extra/rank1.pt"} <= set(manifest["files"])

    # 2 ranks -> 1 process (which then trains on and saves at batch 6)
    if dist.get_rank() == 0:
        run_single_process(str(fsdp_dir), str(single_dir), dump)
    dist.barrier()
    loaded = torch.load(dump + ".loaded", weights_only=False)
    assert loaded["batch"] == 4
    if dist.get_rank() == 0:
        assert_nested_equal(saved, {"model": loaded["model"], "optim": loaded["optim"]})

    # 1 process -> 2 FSDP ranks
    with make_trainer(FSDP(), "8ba", Checkpointer(load_path=str(single_dir))) as back:
        assert back.state.timestamp.batch == 6
        final = torch.load(dump + ".final", weights_only=False)
        mine = full_state(back)
        if dist.get_rank() == 0:
            assert_nested_equal(mine, {"model": final["model"], "optim": final["optim"]})


@pytest.mark.world_size(2)
def test_hsdp_writes_from_the_first_replica_group_and_loads_fsdp_checkpoints(shared_tmp_path):
    from smalti.core.parallelism import FSDP, HSDP

    fsdp_dir, hsdp_dir = shared_tmp_path / "fsdp", shared_tmp_path / "hsdp"
    trainer = make_trainer(FSDP(), "2ba", Checkpointer(str(fsdp_dir), save_interval="2ba"))
    trainer.fit()
    saved = full_state(trainer)
    # FSDP over 2 ranks (mesh [2]) -> HSDP replicate=2 x shard=1 (mesh [2, 1])
    hsdp = make_trainer(HSDP(replicate=2, shard=1), "4ba", Checkpointer(str(hsdp_dir), save_interval="4ba",
                                                                         load_path=str(fsdp_dir)))
    assert hsdp.state.timestamp.batch == 2
    loaded = full_state(hsdp)
    if dist.get_rank() == 0:
        assert saved["model"] and saved["optim"]["state"]
    assert_nested_equal(saved, loaded)
    hsdp.fit()
    manifest = json.loads((hsdp_dir / "ep0-ba4" / "manifest.json").read_text())
    assert manifest["mesh_shape"] == [2, 1] and manifest["writer_ranks"] == [0]
    shards = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    assert shards == ["__0_0.distcp"]  # the second replica group wrote no shards
    assert {"extra/rank0.pt", "extra/rank1.pt"} <= set(manifest["files"])
    final = full_state(hsdp)
    with make_trainer(FSDP(), "4ba", Checkpointer(load_path=str(hsdp_dir))) as back:
        assert_nested_equal(final, full_state(back))


def shared_data_fsdp():
    """FSDP over both ranks that read the same data (one data-parallel share), as a sequence-parallel pair does."""
    from smalti.core.parallelism import FSDP

    class SharedData(FSDP):
        dp_rank = 0
        dp_world_size = 1

    return SharedData()


@pytest.mark.world_size(2)
def test_stateful_loader_position_follows_the_data_parallel_share_not_the_rank(shared_tmp_path):
    from smalti.core import Trainer
    from smalti.core.examples import MLPRegressor
    from smalti.core.parallelism import FSDP

    sys.path.insert(0, SUPPORT)
    from stateful_loader import PositionLoader

    folder = shared_tmp_path / "one"
    if dist.get_rank() == 0:  # saved by one process, 3 batches into its loader
        run_single_process(str(folder), "", "", script=STATEFUL_SAVE)
    dist.barrier()

    def two_ranks(parallelism, load_path=folder, **options):
        torch.manual_seed(0)
        return Trainer(MLPRegressor(), PositionLoader(), "4ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                       parallelism=parallelism, callbacks={"checkpoint": Checkpointer(load_path=str(load_path), **options)})

    # 1 share -> 2 shares: the position cannot be split.
    with pytest.raises(ReshardError, match=r"ep0-ba3.*each of 1 data-parallel ranks \(1 ranks\).*over 2 data-parallel "
                                           r"ranks \(2 ranks\).*load_ignore_keys"):
        two_ranks(FSDP())
    with two_ranks(FSDP(), load_ignore_keys=["dataloader"]) as restarted:  # the documented way out
        assert restarted.state.timestamp.batch == 3 and restarted.state.train_dataloader.position == 0
    # 1 share -> 2 ranks reading that one share: both continue the saved position.
    with two_ranks(shared_data_fsdp()) as shared:
        assert shared.state.dp_world_size == 1 and shared.state.train_dataloader.position == 3

    # 2 shares on 2 ranks -> 2 ranks reading one share: the same world size, but the position cannot follow.
    saved = shared_tmp_path / "two"
    torch.manual_seed(0)
    Trainer(MLPRegressor(), PositionLoader(), "3ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
            parallelism=FSDP(), callbacks={"checkpoint": Checkpointer(str(saved), save_interval="3ba")}).fit()
    assert json.loads((saved / "ep0-ba3" / "manifest.json").read_text())["dp_world_size"] == 2
    with pytest.raises(ReshardError, match=r"each of 2 data-parallel ranks \(2 ranks\).*over 1 data-parallel ranks"):
        two_ranks(shared_data_fsdp(), load_path=saved / "ep0-ba3")


@pytest.mark.world_size(2)
def test_a_signal_on_one_rank_makes_every_rank_save_and_stop(shared_tmp_path):
    from smalti.core import Callback
    from smalti.core.parallelism import FSDP

    class Preempt(Callback):
        def on_batch_end(self, state):
            if state.timestamp.batch == 3 and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.getsignal(signal.SIGUSR1)
    trainer = make_trainer(FSDP(), "20ba", Checkpointer(str(shared_tmp_path / "ck"), save_interval="10ba",
                                                        save_on_signal=["SIGUSR1"]), callbacks={"preempt": Preempt()})
    trainer.fit()
    assert trainer.state.timestamp.batch == 3  # rank 0 got no signal and stopped at the same batch
    manifest = json.loads((shared_tmp_path / "ck" / "ep0-ba3" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["timestamp"]["batch"] == 3
    assert signal.getsignal(signal.SIGUSR1) is previous


@pytest.mark.world_size(2)
def test_ranks_split_the_data_hash_check_and_a_bad_file_in_either_share_falls_back(shared_tmp_path, monkeypatch):
    import smalti.checkpoint.loading as loading
    from smalti.checkpoint import state_io
    from smalti.core.parallelism import FSDP

    folder = shared_tmp_path / "ckpt"
    make_trainer(FSDP(), "4ba", Checkpointer(str(folder), save_interval="2ba")).fit()
    at_batch_2 = make_trainer(FSDP(), "2ba", Checkpointer(str(shared_tmp_path / "ref"), save_interval=None,
                                                          save_on_fit_end=False))
    at_batch_2.fit()
    reference = full_state(at_batch_2)
    checked = []
    real = loading.ReadAhead

    def spy(where, files, *args):
        checked.append((where.name, sorted(f.relpath for f in files if f.hash)))
        return real(where, files, *args)

    monkeypatch.setattr(loading, "ReadAhead", spy)
    prefilled = []  # AdamW's state is made from the checkpoint (sharded like the parameters), not by a zero-lr step
    real_prefill = state_io._prefill_adam_state
    monkeypatch.setattr(state_io, "_prefill_adam_state", lambda *args: prefilled.append(real_prefill(*args)) or prefilled[-1])
    for bad in ("__0_0.distcp", "__1_0.distcp"):  # one lands in each rank's share
        path = folder / "ep0-ba4" / bad
        good = path.read_bytes()
        dist.barrier()
        if dist.get_rank() == 0:
            flipped = bytearray(good)
            flipped[len(flipped) // 2] ^= 0x01
            path.write_bytes(bytes(flipped))
        dist.barrier()
        checked.clear()
        resumed = make_trainer(FSDP(), "6ba", Checkpointer(str(folder), save_interval=None, save_on_fit_end=False,
                                                          autoresume=True))
        assert resumed.state.timestamp.batch == 2
        assert_nested_equal(reference, full_state(resumed))
        assert prefilled and all(prefilled)
        resumed.close()
        # each rank read ahead and hashed the data file it wrote (the one it loads) of each checkpoint tried:
        # ep0-ba4 (bad), then ep0-ba2
        everyone = [None, None]
        dist.all_gather_object(everyone, checked)
        for name in ("ep0-ba4", "ep0-ba2"):
            shares = [[files for where, files in everyone[rank] if where == name] for rank in range(2)]
            assert shares == [[["__0_0.distcp"]], [["__1_0.distcp"]]], everyone
        dist.barrier()
        if dist.get_rank() == 0:
            path.write_bytes(good)
        dist.barrier()


@pytest.mark.world_size(2)
def test_a_crafted_rank_file_read_by_one_rank_fails_every_rank_and_runs_nothing(shared_tmp_path):
    """Only rank 1 reads extra/rank1.pt: rank 0 must fail with it (not go on alone into a collective that
    rank 1 never joins), and nothing in the file runs."""
    from smalti.checkpoint import UnsafeCheckpointError
    from smalti.checkpoint.manifest import hash_file, seal
    from smalti.core.parallelism import FSDP

    folder, marker = shared_tmp_path / "ck", shared_tmp_path / "code-ran"
    make_trainer(FSDP(), "2ba", Checkpointer(str(folder), save_interval="2ba")).fit()
    dist.barrier()
    if dist.get_rank() == 0:
        checkpoint = folder / "ep0-ba2"
        extra = torch.load(checkpoint / "extra" / "rank1.pt", weights_only=True)
        extra["note"] = RunsCode(marker)
        torch.save(extra, checkpoint / "extra" / "rank1.pt")
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        size, sha = hash_file(checkpoint / "extra" / "rank1.pt")
        manifest["files"]["extra/rank1.pt"] = {"size": size, "sha256": sha}
        manifest.pop("manifest_sha256")
        (checkpoint / "manifest.json").write_text(json.dumps(seal(manifest)))
    dist.barrier()
    with pytest.raises(UnsafeCheckpointError, match=r"rank1\.pt wants builtins\.eval"):
        make_trainer(FSDP(), "4ba", Checkpointer(load_path=str(folder / "ep0-ba2"), timeout_s=60))
    assert not marker.exists()
    dist.barrier()
