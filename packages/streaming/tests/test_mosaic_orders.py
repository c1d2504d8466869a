"""smalti's mosaicml-streaming orders against the orders recorded from mosaicml-streaming 0.13.0 itself.

The records and the script that made them are in ``golden/`` (see ``golden/record_mosaic_orders.py``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from smalti.streaming import StreamingDataset
from smalti.streaming.errors import StreamingError
from smalti.streaming.order_mosaic import mosaic_partition, mosaic_rank_order, mosaic_shuffle, mosaic_work

HERE = Path(__file__).resolve().parent


def load_records(path: Path) -> dict[str, np.ndarray]:
    """The recorded orders by key (the file keeps each kind's orders end to end, see the recording script)."""
    packed = np.load(path)
    records = {}
    for kind in sorted({name.rsplit("_", 1)[0] for name in packed.files}):
        flat, at = packed[f"{kind}_flat"].astype(np.int64), 0
        for name, shape in zip(packed[f"{kind}_keys"], json.loads(str(packed[f"{kind}_shapes"]))):
            size = int(np.prod(shape))
            records[str(name)] = flat[at : at + size].reshape(shape)
            at += size
    return records


RECORDS = load_records(HERE / "golden" / "mosaic_orders.npz")
SHARD_SIZES = np.random.default_rng(2024).integers(1, 120, 23)  # as the recording script's shard_sizes()


def cases(kind: str) -> list[tuple[str, dict[str, int | str]]]:
    out = []
    for name in RECORDS:
        head, *fields = name.split("|")
        if head == kind:
            setting = dict(f.split("=", 1) for f in fields)
            out.append((name, {k: v if k == "algo" else int(v) for k, v in setting.items()}))
    return out


def test_the_records_cover_every_algorithm_and_layout() -> None:
    shuffles, partitions, datasets = cases("shuffle"), cases("partition"), cases("dataset")
    assert {c["algo"] for _, c in shuffles} == {c["algo"] for _, c in datasets} == {
        "naive", "py1s", "py2s", "py1br", "py1e"}
    assert {c["ncn"] for _, c in shuffles} == {1, 3, 8} and len({c["seed"] for _, c in shuffles}) == 2
    for field in ("ncn", "nodes", "ranks", "workers", "batch", "drop"):
        assert len({c[field] for _, c in partitions}) >= 3, field


@pytest.mark.parametrize("name,case", cases("shuffle"), ids=lambda x: x if isinstance(x, str) else "")
def test_shuffle_equals_mosaicml_streaming(name: str, case: dict) -> None:
    got = mosaic_shuffle(SHARD_SIZES, case["algo"], case["ncn"], case["seed"], case["epoch"], case["block"])
    np.testing.assert_array_equal(got, RECORDS[name])


def test_partitions_equal_mosaicml_streaming() -> None:
    """Every recorded layout (samples, canonical and physical nodes, ranks, workers, batch, resume point)."""
    wrong = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, c in cases("partition"):
            got = mosaic_partition(c["n"], c["ncn"], c["nodes"], c["ranks"], c["workers"], c["batch"], c["drop"])
            if got.shape != RECORDS[name].shape or not np.array_equal(got, RECORDS[name]):
                wrong.append(name)
    assert not wrong, f"{len(wrong)} of {len(cases('partition'))} partitions differ, e.g. {wrong[:3]}"


@pytest.mark.parametrize("name,case", cases("dataset"), ids=lambda x: x if isinstance(x, str) else "")
def test_dataset_yields_mosaicml_streamings_order(name: str, case: dict, tmp_path) -> None:
    """What a real mosaicml-streaming StreamingDataset yielded through a DataLoader, from smalti's dataset."""
    ds = StreamingDataset(local=str(HERE / "fixtures" / "plain"), batch_size=case["batch"],
                          shuffle=bool(case["shuffle"]), shuffle_algo=case["algo"], shuffle_seed=case["seed"],
                          shuffle_block_size=case["block"], num_canonical_nodes=case["ncn"], rank=0, world_size=1)
    assert ds.mosaic_layout()
    got = [int(s["id"]) for s in ds]
    np.testing.assert_array_equal(got, RECORDS[name])
    assert len(ds) == len(got)


@pytest.mark.parametrize("algo", ["py1e", "py2s"])
def test_every_rank_of_a_multi_node_world_yields_its_mosaic_share(algo: str) -> None:
    """2 nodes x 2 ranks, resumed after 3 global batches: each rank's batches are its partition's, in order."""
    local = str(HERE / "fixtures" / "plain")
    kw = {"batch_size": 5, "shuffle": True, "shuffle_algo": algo, "shuffle_seed": 123, "shuffle_block_size": 50,
          "num_canonical_nodes": 4, "world_size": 4, "local_world_size": 2}
    for rank in range(4):
        ds = StreamingDataset(local=local, rank=rank, **kw)
        sizes = np.diff(ds._shard_starts)
        ds.load_state_dict({"epoch": 0, "sample_in_epoch": 60, "num_canonical_nodes": 4, "shuffle_seed": 123,
                            "shuffle_algo": algo})
        work = mosaic_work(sizes, shuffle=True, algo=algo, seed=123, epoch=0, num_canonical_nodes=4, block_size=50,
                           num_nodes=2, ranks_per_node=2, workers_per_rank=3, batch_size=5, drop_first=60)
        expected = mosaic_rank_order(work, rank // 2, rank % 2)
        np.testing.assert_array_equal([int(s["id"]) for s in ds], expected)


def test_weighted_streams_keep_smaltis_own_layout(tmp_path) -> None:
    """Outside what mosaicml-streaming's order covers here (an epoch_size), the dataset says so."""
    ds = StreamingDataset(local=str(HERE / "fixtures" / "plain"), batch_size=4, shuffle=True, shuffle_algo="py1e",
                          epoch_size=100, rank=0, world_size=1)
    assert not ds.mosaic_layout() and len(list(ds)) == 100


def test_bad_settings_are_named() -> None:
    with pytest.raises(StreamingError, match="num_canonical_nodes=3 and the physical node count 2"):
        mosaic_partition(100, 3, 2, 1, 1, 1)
    with pytest.raises(StreamingError, match="shuffle_block_size=1 is too small for py1br"):
        mosaic_shuffle([10, 10], "py1br", 1, 0, 0, 1)
    with pytest.raises(StreamingError, match="canonical node 0 gets no samples"):
        mosaic_shuffle([1, 1], "py1e", 3, 0, 0, 40)
    with pytest.raises(StreamingError, match="'blocks' is not one of mosaicml-streaming's"):
        mosaic_shuffle([1, 1], "blocks", 1, 0, 0, 40)
