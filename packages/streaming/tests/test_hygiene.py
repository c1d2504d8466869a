"""Real iteration on several topologies, a run after a killed one, and datasets under pytest-xdist."""

import glob
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from smalti.streaming import StreamingDataset


def read_as_rank(env, remote, local, out, workers):
    """One rank's process: the environment torchrun would give it, this node's cache, its batches to ``out``."""
    os.environ.update(env)
    ds = StreamingDataset(remote=str(remote), local=str(local), batch_size=8, shuffle=True, shuffle_algo="py1e",
                          num_canonical_nodes=4, shuffle_block_size=64)
    batches = [b["id"].tolist() for b in DataLoader(ds, batch_size=8, num_workers=workers)]
    out.write_text(json.dumps({"batches": batches, "layout": [ds.physical_nodes, ds.local_world, ds.local_rank]}))


def global_batches(per_rank):
    assert len({len(r) for r in per_rank}) == 1
    return [sorted(np.concatenate([r[b] for r in per_rank]).tolist()) for b in range(len(per_rank[0]))]


@pytest.mark.parametrize(("nodes", "ranks", "workers"), [(2, 2, 3), (4, 1, 1)])
def test_iterated_global_batches_match_on_1x4_2x2_4x1_and_1_or_3_workers(dataset_dir, tmp_path, nodes, ranks,
                                                                          workers):
    """Every rank a process (RANK/WORLD_SIZE/LOCAL_WORLD_SIZE as torchrun sets them), one cache per node."""
    world = nodes * ranks
    # Reference: 1 node x 4 ranks reading the dataset in place, each rank iterated in this process.
    reference = global_batches([
        [b["id"].tolist() for b in DataLoader(
            StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, shuffle_algo="py1e",
                             num_canonical_nodes=4, shuffle_block_size=64, rank=r, world_size=4,
                             local_world_size=4), batch_size=8)]
        for r in range(4)])
    assert {i for b in reference for i in b} == set(range(1003))  # every sample (plus padding repeats)
    # Forked (torch is already imported here), like the DataLoader's own workers.
    ctx = multiprocessing.get_context("fork")
    procs = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % ranks),
               "LOCAL_WORLD_SIZE": str(ranks)}
        args = (env, dataset_dir, tmp_path / f"node{rank // ranks}", tmp_path / f"rank{rank}.json", workers)
        procs.append(ctx.Process(target=read_as_rank, args=args))
        procs[-1].start()
    try:
        for proc in procs:
            proc.join(timeout=120)
            assert proc.exitcode == 0, f"rank process exited with {proc.exitcode}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["layout"] for r in results] == [[nodes, ranks, r % ranks] for r in range(world)]
    per_rank = [r["batches"] for r in results]
    assert global_batches(per_rank) == reference
    # The node layout is real: each node's cache holds its canonical nodes' shards, about 1/nodes of them.
    total = len(json.loads((dataset_dir / "index.json").read_text())["shards"])
    cached = [{p.name for p in (tmp_path / f"node{n}").glob("shard.*")} for n in range(nodes)]
    assert len(set().union(*cached)) == total
    assert all(len(c) <= total // nodes + 3 for c in cached), [len(c) for c in cached]


KILLED = r"""
import os, sys
from torch.utils.data import DataLoader
from smalti.streaming import StreamingDataset
ds = StreamingDataset(local=sys.argv[1], batch_size=8, shuffle=True)
for step, batch in enumerate(DataLoader(ds, batch_size=8, num_workers=2)):
    if step == 3:
        os.kill(os.getpid(), 9)
"""


def test_a_run_after_a_killed_one_reads_the_exact_epoch(make_dataset, tmp_path):
    data = make_dataset(tmp_path / "data", n=600)
    reference = make_dataset(tmp_path / "reference", n=600)
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    proc = subprocess.run([sys.executable, str(script), str(data)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]

    def epoch(path):
        ds = StreamingDataset(local=str(path), batch_size=8, shuffle=True)
        return [i for b in DataLoader(ds, batch_size=8, num_workers=2) for i in b["id"].tolist()]

    assert epoch(data) == epoch(reference)


XDIST_TESTS = r"""
import os
import numpy as np
import pytest
from torch.utils.data import DataLoader
from smalti.streaming import MDSWriter, StreamingDataset

SHARED = os.environ["SHARED_DATA"]


@pytest.mark.parametrize("seed", range(4))
def test_epoch(seed, tmp_path):
    own = tmp_path / "own"
    with MDSWriter(own, {"id": "int"}, compression="zstd", size_limit=500) as w:
        for i in range(300):
            w.write({"id": i})
    for local in (own, SHARED):  # one dataset per test, and one cache directory all workers share
        ds = StreamingDataset(local=str(local), batch_size=4, shuffle=True, shuffle_seed=seed)
        got = [i for b in DataLoader(ds, batch_size=4, num_workers=2) for i in b["id"].tolist()]
        assert sorted(got) == list(range(300))
"""


def test_datasets_under_pytest_xdist_leave_nothing_behind(make_dataset, tmp_path):
    pytest.importorskip("xdist")
    shared = tmp_path / "shared"
    from smalti.streaming import MDSWriter

    with MDSWriter(shared, {"id": "int"}, compression="zstd", size_limit=500) as w:
        for i in range(300):
            w.write({"id": i})

    # A private temporary directory: other users of the machine create and remove files in the shared one. It
    # must be short: multiprocessing puts the AF_UNIX socket through which torch passes a batch's shared-memory
    # file descriptor from a DataLoader worker at $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and a socket path
    # over 107 bytes fails in the worker's queue feeder thread, which only logs the error and drops the batch,
    # so the DataLoader waits forever. Under tmp_path this path was 108 bytes when this test itself ran in an
    # xdist worker (basetemp/popen-gw0/...), 98 otherwise: that, not xdist, hung the inner run.
    private_tmp = Path(tempfile.mkdtemp(prefix="smalti-xdist-"))
    socket_path = private_tmp / "pymp-12345678" / "listener-12345678"
    assert len(os.fsencode(socket_path)) <= 107, f"TMPDIR {private_tmp} too long for AF_UNIX sockets"
    try:
        (tmp_path / "test_xdist_epochs.py").write_text(XDIST_TESTS)
        # The inner run's own time-out turns a hang into a failure with the stacks of every thread.
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                               "--timeout", "120", "--basetemp", str(tmp_path / "base"),
                               str(tmp_path / "test_xdist_epochs.py")],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "SHARED_DATA": str(shared), "TMPDIR": str(private_tmp)})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        assert "4 passed" in proc.stdout
        assert not list(private_tmp.rglob("*")), "files left in the temporary directory"
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
    assert not glob.glob(f"{tmp_path}/base/**/*lock*", recursive=True)
    assert not [p for p in shared.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]
    assert json.loads((shared / "index.json").read_text())["version"] == 2
