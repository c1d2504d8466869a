"""Batched reads: ``__getitems__``, columnar shards and ``StreamingDataLoader``'s whole-batch path give exactly
what the per-sample path gives, in the same order, with the same resume state."""

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset

from smalti.streaming import (
    MDSWriter,
    ShardCorruptError,
    StreamingDataLoader,
    StreamingDataset,
    read_shard_samples,
)

FIXTURES = Path(__file__).parent / "fixtures"
COLUMNS = {"id": "int", "f16": "float16", "u8": "uint8", "i64": "int64", "x": "ndarray:float32:2,3",
           "t": "ndarray:uint16:5"}


def write_columnar(path, n=300, size_limit=3000, compression="zstd"):
    rng = np.random.default_rng(1)
    with MDSWriter(path, COLUMNS, compression=compression, size_limit=size_limit) as writer:
        for i in range(n):
            writer.write({"id": i, "f16": np.float16(i / 7), "u8": np.uint8(i % 256), "i64": np.int64(-i),
                          "x": rng.standard_normal((2, 3)).astype(np.float32),
                          "t": rng.integers(0, 65535, 5, dtype=np.uint16)})
    return path


def write_mixed(path, n=120):
    """A dataset with a variable-size column: not columnar, read sample by sample."""
    with MDSWriter(path, {"id": "int", "text": "str", "x": "ndarray:int32:3"}, compression="zstd",
                   size_limit=1500) as writer:
        for i in range(n):
            writer.write({"id": i, "text": "w" * (i % 13), "x": np.arange(3, dtype=np.int32) + i})
    return path


def same_sample(a, b):
    assert list(a) == list(b)
    for key in a:
        assert type(a[key]) is type(b[key]), key
        if isinstance(a[key], np.ndarray):
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape
            assert np.array_equal(a[key], b[key]) and a[key].flags.writeable
        else:
            assert a[key] == b[key]


def same_batch(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):  # a custom collate's arrays stay arrays (no conversion to tensors)
        assert type(b) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            same_batch(a[key], b[key])
    else:
        assert a == b


@pytest.mark.parametrize("writer", [write_columnar, write_mixed])
def test_getitems_returns_the_samples_of_getitem_in_the_same_order(tmp_path, writer):
    ds = StreamingDataset(local=str(writer(tmp_path / "d")), batch_size=8)
    assert len(ds.cache.shards) > 3
    idx = [5, 299 % ds.num_samples, 0, 5, 77, 31, 118, 2, 64, 64]  # across shards, unsorted, repeated
    got = ds.__getitems__(idx)
    for i, sample in zip(idx, got, strict=True):
        same_sample(sample, ds[i])
    got[0][next(k for k in got[0] if isinstance(got[0][k], np.ndarray))][...] = 0  # samples own their memory
    same_sample(ds.__getitems__([5])[0], ds[5])
    with pytest.raises(IndexError, match=f"sample {ds.num_samples} is out of range"):
        ds.__getitems__([1, ds.num_samples])
    # Torch's map-style fetcher calls __getitems__ with a whole batch (a Subset forwards it).
    loader = DataLoader(Subset(ds, idx), batch_size=4)
    assert [int(i) for b in loader for i in b["id"]] == idx


@pytest.mark.parametrize("name", ["plain", "zstd7_sha1_xxh3", "tokens_zstd"])
def test_getitems_decodes_golden_fixtures_exactly(tmp_path, name):
    shutil.copytree(FIXTURES / name, tmp_path / name)
    expected = list(read_shard_samples(tmp_path / name))
    ds = StreamingDataset(local=str(tmp_path / name), batch_size=4)
    order = list(range(len(expected)))[::-1]
    for i, sample in zip(order, ds.__getitems__(order), strict=True):
        same_sample(sample, expected[i])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_streaming_dataloader_batches_equal_a_plain_dataloaders(tmp_path, workers, drop_last):
    data = write_columnar(tmp_path / "d")

    def make(rank=0):
        return StreamingDataset(local=str(data), batch_size=8, shuffle=True, num_canonical_nodes=2,
                                rank=rank, world_size=2)

    for rank in (0, 1):
        plain = list(DataLoader(make(rank), batch_size=8, num_workers=workers, drop_last=drop_last))
        fast = StreamingDataLoader(make(rank), batch_size=8, num_workers=workers, drop_last=drop_last)
        assert fast.batched
        got = list(fast)
        assert len(got) == len(plain) == len(fast) and len(plain) > 5
        for a, b in zip(got, plain):
            same_batch(a, b)
    # the last, padded global batch: with a resume point not on a batch boundary rank 1's share is partial
    state = {"epoch": 0, "sample_in_epoch": 21, "num_canonical_nodes": 2, "shuffle_seed": 9176}
    ds_plain, ds_fast = make(1), make(1)
    ds_plain.load_state_dict(state)
    ds_fast.load_state_dict(state)
    plain = list(DataLoader(ds_plain, batch_size=8, num_workers=workers, drop_last=drop_last))
    got = list(StreamingDataLoader(ds_fast, batch_size=8, num_workers=workers, drop_last=drop_last))
    assert [len(b["id"]) for b in got] == [len(b["id"]) for b in plain]
    for a, b in zip(got, plain, strict=True):
        same_batch(a, b)


def test_streaming_dataloader_keeps_custom_collate_and_variable_columns(tmp_path):
    ds = StreamingDataset(local=str(write_mixed(tmp_path / "d")), batch_size=8, shuffle=True)

    def collate(samples):
        return {"ids": np.array([s["id"] for s in samples]), "text": "|".join(s["text"] for s in samples)}

    for collate_fn in (None, collate):
        plain = list(DataLoader(ds, batch_size=8, collate_fn=collate_fn, num_workers=1))
        got = list(StreamingDataLoader(ds, batch_size=8, collate_fn=collate_fn, num_workers=1))
        assert len(got) == len(plain) == 15
        for a, b in zip(got, plain):
            same_batch(a, b)


def test_batched_loader_resume_state_equals_the_per_sample_loaders(tmp_path):
    data = write_columnar(tmp_path / "d")

    def run(batch_size, stop, workers):
        ds = StreamingDataset(local=str(data), batch_size=8, shuffle=True)
        loader = StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers)
        seen = []
        for step, batch in enumerate(loader):
            seen += batch["id"].tolist()
            if step == stop:
                break
        return loader, seen

    fast, fast_seen = run(8, 4, 2)  # the whole-batch path
    slow, slow_seen = run(4, 9, 0)  # another batch size: sample by sample
    assert fast.batched and not slow.batched
    assert fast_seen == slow_seen and len(fast_seen) == 40
    assert fast.state_dict() == slow.state_dict() and fast.state_dict()["sample_in_epoch"] == 40
    resumed = StreamingDataset(local=str(data), batch_size=8, shuffle=True)
    loader = StreamingDataLoader(resumed, batch_size=8, num_workers=2)
    loader.load_state_dict(fast.state_dict())
    rest = [i for b in loader for i in b["id"].tolist()]
    full = [i for b in DataLoader(StreamingDataset(local=str(data), batch_size=8, shuffle=True), batch_size=8)
            for i in b["id"].tolist()]
    assert fast_seen + rest == full
    assert loader.state_dict()["epoch"] == 1 and loader.dataset.epoch == 1  # the view forwards attributes


def test_a_shard_whose_offsets_break_the_stride_is_never_read_as_columns(tmp_path):
    data = write_columnar(tmp_path / "d", n=40, size_limit=100_000, compression=None)
    shard = data / "shard.00000.mds"
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack_from("<I", raw, 0)
    offsets = list(struct.unpack_from(f"<{n + 1}I", raw, 4))
    struct.pack_into("<I", raw, 4 + 4 * 3, offsets[3] + 2)  # sample 2 ends, and sample 3 starts, 2 bytes late
    shard.write_bytes(bytes(raw))
    ds = StreamingDataset(local=str(data), batch_size=8, validate_hash=False)
    assert ds.cache.reader(0).column_views() is None
    with pytest.raises(ShardCorruptError, match="sample 2 holds"):
        ds.__getitems__([0, 1, 2])
    with pytest.raises(ShardCorruptError, match="sample 2 holds"):
        list(StreamingDataLoader(ds, batch_size=8))


def test_a_subclass_that_changes_its_samples_keeps_its_change_in_the_loader(tmp_path):
    """LLM Foundry's pattern: a StreamingDataset subclass whose __getitem__/__iter__ turn a raw sample into the
    model's input. The whole-batch path reads shards directly, so it must not be used for such a dataset."""
    write_columnar(tmp_path / "ds", n=40)

    class Renamed(StreamingDataset):
        def __getitem__(self, index):
            return {"input": super().__getitem__(index)["t"].astype(np.int64)}

        def __iter__(self):
            for sample in super().__iter__():
                yield {"input": sample["t"].astype(np.int64)}

    ds = Renamed(local=str(tmp_path / "ds"), batch_size=8, shuffle=False)
    loader = StreamingDataLoader(ds, batch_size=8)
    batches = list(loader)
    assert not loader.batched and len(batches) == 5
    assert list(batches[0]) == ["input"] and batches[0]["input"].dtype == torch.int64
    plain = StreamingDataset(local=str(tmp_path / "ds"), batch_size=8, shuffle=False)
    expected = torch.cat([b["t"] for b in StreamingDataLoader(plain, batch_size=8)]).long()
    assert torch.equal(torch.cat([b["input"] for b in batches]), expected)


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("cap", [1, 4, 16])
def test_bundles_cover_every_step_once_in_the_order_the_loader_takes_them(workers, cap):
    from smalti.streaming.dataset import _bundles

    for steps in (0, 1, 5, 37, 200):
        per_worker = [list(_bundles(steps, w, workers, cap)) for w in range(workers)]
        taken, k = [], 0  # the DataLoader takes one item from each worker in turn
        while any(per_worker):
            if per_worker[k % workers]:
                taken.append(per_worker[k % workers].pop(0))
            k += 1
        assert [s for lo, hi in taken for s in range(lo, hi)] == list(range(steps))
        assert all(hi - lo <= cap for lo, hi in taken)
        assert all(hi - lo == 1 for lo, hi in taken[:workers])  # each worker's first batch is not held back


def test_workers_hand_over_sample_ids_and_any_process_makes_the_batches(tmp_path, monkeypatch):
    """A worker's bundle holds sample ids, not samples; a fresh copy of the dataset (the loader's main process)
    turns it into exactly the batches a plain DataLoader yields, from its own mapping of the shard files."""
    import pickle

    from smalti.streaming import mds
    from smalti.streaming.dataset import Bundle

    remote = write_columnar(tmp_path / "remote")

    def make():
        return StreamingDataset(remote=str(remote), local=str(tmp_path / "cache"), batch_size=8, shuffle=True)

    plain = list(DataLoader(make(), batch_size=8))
    bundles = list(make().iter_batches(bundles=True))
    assert all(type(b) is Bundle and b.batches is None for b in bundles) and len(bundles) < len(plain)
    assert sum(len(b.refs) for b in bundles) == len(plain)
    # the ids of the samples (here equal to the "id" column), as one small int64 array per batch
    assert [i for b in bundles for r in b.refs for i in r.tolist()] == [i for b in plain for i in b["id"].tolist()]
    assert all(r.dtype == np.int64 for b in bundles for r in b.refs)
    assert type(pickle.loads(pickle.dumps(bundles[-1]))) is Bundle

    main = make()
    shard = main.cache.raw_path(int(main._locate(bundles[-1].refs[0])[0][0]))
    shard.unlink()  # evicted after the worker handed the bundle over: fetched again here
    checked = []
    real_digest = mds.file_digest
    monkeypatch.setattr(mds, "file_digest", lambda *a, **k: checked.append(a[0]) or real_digest(*a, **k))
    got = [batch for bundle in bundles for batch in main.resolve(bundle)]
    assert checked == [] and shard.exists()  # copies a worker vouched for are not hashed again
    make().cache.reader(0)
    assert checked == [main.cache.raw_path(0)]  # (a process opening a copy on its own checks it)
    assert len(got) == len(plain)
    for a, b in zip(got, plain):
        same_batch(a, b)
    assert main.resolve(Bundle(refs=[])) == []


def test_the_first_batch_is_made_here_and_passed_over_by_the_workers(tmp_path, monkeypatch):
    """With workers handing over bundles, the loader's process makes the first batch itself from the shards its
    dataset's warm-up makes, and passes over worker 0's first bundle (those same ids): nothing is made twice."""
    from torch.utils.data import get_worker_info

    data = write_columnar(tmp_path / "d")
    plain = list(DataLoader(StreamingDataset(local=str(data), batch_size=8, shuffle=True), batch_size=8))
    for raw in data.glob("shard.*.mds"):
        raw.unlink()  # back to zips only: the warm-up has work to do
    made = []
    collate = StreamingDataset._collate_columns

    def record(self, ids, plan, vouched=False, readers=None):
        if get_worker_info() is None:
            made.append((ids.tolist(), vouched))
        return collate(self, ids, plan, vouched, readers)

    monkeypatch.setattr(StreamingDataset, "_collate_columns", record)
    got = list(StreamingDataLoader(StreamingDataset(local=str(data), batch_size=8, shuffle=True), batch_size=8,
                                   num_workers=2))
    assert len(got) == len(plain) > 5
    for a, b in zip(got, plain, strict=True):
        same_batch(a, b)
    assert made[0] == (plain[0]["id"].tolist(), False)  # here, from this process's own copies
    assert all(vouched for _, vouched in made[1:])  # then from the workers' bundles
    assert sum(len(ids) for ids, _ in made) == sum(len(b["id"]) for b in plain)  # each batch made once


def test_the_first_batch_is_handed_out_before_the_workers_start(tmp_path, monkeypatch):
    """The workers' start-up (forks) comes after the first batch, not before it: the first batch of an epoch
    waits only for its own rows, and the workers start on the main thread at the next ``next()``."""
    import multiprocessing.process
    import threading

    started = []  # (process name, thread) of each start: a worker that has handed out its share may have exited
    start = multiprocessing.process.BaseProcess.start

    def recording_start(process):
        started.append((process.name, threading.current_thread()))
        start(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    data = write_columnar(tmp_path / "d")
    plain = list(DataLoader(StreamingDataset(local=str(data), batch_size=8, shuffle=True), batch_size=8))
    for raw in data.glob("shard.*.mds"):
        raw.unlink()
    loader = StreamingDataLoader(StreamingDataset(local=str(data), batch_size=8, shuffle=True), batch_size=8,
                                 num_workers=2)
    it = iter(loader)
    got = [next(it)]
    assert started == []  # no worker yet
    assert loader.state_dict()["sample_in_epoch"] == 8
    got.append(next(it))
    assert len(started) == 2
    assert all(thread is threading.main_thread() for _, thread in started)
    got.extend(it)
    assert len(got) == len(plain)
    for a, b in zip(got, plain, strict=True):
        same_batch(a, b)


def _record_seed(worker_id):
    import os

    with open(os.path.join(os.environ["SMALTI_TEST_SEEDS"], str(worker_id)), "w") as f:
        f.write(str(torch.initial_seed()))


def test_workers_started_after_the_first_batch_keep_the_seed_and_epoch_of_iter(tmp_path, monkeypatch):
    """Workers started at the second ``next()`` get the base seed and the epoch they would have got at
    ``iter()``: torch's global random stream moves at ``iter()`` as before, and a ``set_epoch`` after the first
    batch takes effect at the next ``iter()``, not in the middle of the epoch."""
    data = write_columnar(tmp_path / "d")
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    monkeypatch.setenv("SMALTI_TEST_SEEDS", str(seeds))

    def make():
        return StreamingDataset(local=str(data), batch_size=8, shuffle=True)

    later = make()
    later.set_epoch(5)
    epoch0, epoch5 = ([b["id"].tolist() for b in DataLoader(ds, batch_size=8)] for ds in (make(), later))
    torch.manual_seed(3)
    base_seed = torch.empty((), dtype=torch.int64).random_().item()
    after_iter = torch.rand(4)

    loader = StreamingDataLoader(make(), batch_size=8, num_workers=2, worker_init_fn=_record_seed)
    torch.manual_seed(3)
    it = iter(loader)
    got = [next(it)["id"].tolist()]
    assert torch.equal(torch.rand(4), after_iter)  # the model's stream, as if the workers had started already
    loader.streaming_dataset.set_epoch(5)
    got.extend(b["id"].tolist() for b in it)
    assert got == epoch0
    assert {int(p.name): int(p.read_text()) for p in seeds.iterdir()} == {0: base_seed, 1: base_seed + 1}
    assert loader.streaming_dataset.epoch == 5 and epoch5 != epoch0
    assert [b["id"].tolist() for b in loader] == epoch5


def test_the_loaders_own_generator_moves_at_iter_as_before(tmp_path, monkeypatch):
    """A loader with a generator of its own: the workers' seed is drawn from it as of ``iter()``, and the
    generator has moved by that draw when the first batch is out, whatever draws from it meanwhile."""
    data = write_columnar(tmp_path / "d")
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    monkeypatch.setenv("SMALTI_TEST_SEEDS", str(seeds))
    expected = torch.Generator().manual_seed(7)
    base_seed = torch.empty((), dtype=torch.int64).random_(generator=expected).item()
    own = torch.Generator().manual_seed(7)
    loader = StreamingDataLoader(StreamingDataset(local=str(data), batch_size=8, shuffle=True), batch_size=8,
                                 num_workers=2, generator=own, worker_init_fn=_record_seed)
    it = iter(loader)
    next(it)
    assert torch.equal(own.get_state(), expected.get_state())
    torch.rand(3, generator=own)  # a draw between the batches does not change the workers' seed
    list(it)
    assert {int(p.name): int(p.read_text()) for p in seeds.iterdir()} == {0: base_seed, 1: base_seed + 1}


def test_a_load_state_dict_after_the_first_batch_does_not_reach_the_epoch_in_progress(tmp_path):
    """A state loaded after the first batch, with another ``num_canonical_nodes`` (so another order), does not
    reach the workers started after it: the epoch in progress goes on in its own order."""
    data = write_columnar(tmp_path / "d")

    def make():
        return StreamingDataset(local=str(data), batch_size=8, shuffle=True)

    state = {**make().state_dict(), "num_canonical_nodes": 2, "sample_in_epoch": 16}
    resumed = make()
    resumed.load_state_dict(state)
    plain, other = ([b["id"].tolist() for b in DataLoader(ds, batch_size=8)] for ds in (make(), resumed))
    assert other != plain[2:]

    loader = StreamingDataLoader(make(), batch_size=8, num_workers=2)
    it = iter(loader)
    got = [next(it)["id"].tolist()]
    loader.load_state_dict(state)
    got.extend(b["id"].tolist() for b in it)
    assert got == plain


def test_loader_warns_when_tmpdir_is_too_long_for_worker_sockets(tmp_path, monkeypatch, recwarn):
    """Workers pass tensors through a socket under $TMPDIR; a path over 107 bytes makes them hang silently."""
    import multiprocessing.process
    import tempfile
    import warnings

    data = write_columnar(tmp_path / "d")
    ds = StreamingDataset(local=str(data), batch_size=8)
    long = tmp_path / ("x" * (80 - len(str(tmp_path))))  # 81 bytes: + "/pymp-XXXXXXXX/listener-XXXXXXXX" > 107
    long.mkdir()
    monkeypatch.delitem(multiprocessing.process.current_process()._config, "tempdir", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    with pytest.warns(RuntimeWarning, match=r"TMPDIR is too long.*\(113 bytes\).*at most 107 bytes.*TMPDIR=/tmp"):
        StreamingDataLoader(ds, batch_size=8, num_workers=2)
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        StreamingDataLoader(ds, batch_size=8, num_workers=2)
        StreamingDataLoader(ds, batch_size=8)  # no workers: no socket
