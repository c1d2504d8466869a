"""Record mosaicml-streaming 0.13.0's sample orders into ``mosaic_orders.npz`` (beside this script).

Run it with the real library in a throwaway virtualenv, never in smalti's:

    python -m venv /tmp/mosaic
    /tmp/mosaic/bin/pip install mosaicml-streaming==0.13.0   # with a CPU torch already installed there
    /tmp/mosaic/bin/python packages/streaming/tests/golden/record_mosaic_orders.py

The library imports torchvision for its vision datasets only; when torchvision is absent (no CPU build of it
matches the CPU torch), an empty stand-in module is put in its place: no recorded order goes near it.

Three kinds of record, keyed ``kind|setting=value|...``:

* ``shuffle``: ``streaming.base.shuffle.get_shuffle`` over irregular shard sizes, every algorithm, several
  seeds, epochs, canonical node counts and block sizes;
* ``partition``: ``streaming.base.partition.get_partitions`` over a grid of sample counts, canonical and
  physical node counts, ranks per node, workers, batch sizes and resume points;
* ``dataset``: what a real ``StreamingDataset`` yields through a ``DataLoader`` (one process, 0 or 2 workers)
  over the 300-sample MDS fixture in ``../fixtures/plain``.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ALGOS = ("naive", "py1s", "py2s", "py1br", "py1e")


def stand_in_torchvision() -> None:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        root = types.ModuleType("torchvision")
        datasets, transforms, functional = (types.ModuleType(f"torchvision.{n}")
                                            for n in ("datasets", "transforms", "transforms.functional"))
        datasets.VisionDataset = datasets.CIFAR10 = object
        functional.to_tensor = None
        root.datasets, root.transforms, transforms.functional = datasets, transforms, functional
        for module in (root, datasets, transforms, functional):
            module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        sys.modules.update({"torchvision": root, "torchvision.datasets": datasets,
                            "torchvision.transforms": transforms, "torchvision.transforms.functional": functional})


def shard_sizes() -> np.ndarray:
    """Irregular shard sizes, the same in the tests: 23 shards of 1..120 samples."""
    return np.random.default_rng(2024).integers(1, 120, 23)


def shuffle_cases() -> list[dict]:
    cases = []
    for algo, ncn, (seed, epoch), block in itertools.product(ALGOS, (1, 3, 8), ((123, 0), (9176, 2)), (40, 300)):
        if algo == "naive" and (ncn, block) != (1, 40):
            continue  # naive ignores both
        if algo in ("py1s", "py2s") and block != 40:
            continue  # so do these
        cases.append({"algo": algo, "ncn": ncn, "seed": seed, "epoch": epoch, "block": block})
    return cases


def partition_cases() -> list[dict]:
    cases = []
    for n, ncn, nodes, ranks, workers, batch in itertools.product(
            (97, 300), (1, 2, 4, 8), (1, 2, 4), (1, 3, 8), (1, 2, 3), (1, 4, 7)):
        if max(ncn, nodes) % min(ncn, nodes):
            continue
        if (n + ncn + nodes + ranks + workers + batch) % 4:
            continue  # a quarter of the grid keeps the file small and still varies every setting
        whole = n // 2 // (nodes * ranks * batch) * (nodes * ranks * batch)  # resumed at a global batch
        for drop in sorted({0, whole, 13}):
            cases.append({"n": n, "ncn": ncn, "nodes": nodes, "ranks": ranks, "workers": workers,
                          "batch": batch, "drop": drop})
    cases += [{"n": 5, "ncn": 8, "nodes": 1, "ranks": 2, "workers": 1, "batch": 2, "drop": 0},  # repeats
              {"n": 10, "ncn": 1, "nodes": 4, "ranks": 8, "workers": 2, "batch": 1, "drop": 0}]
    return cases


def dataset_cases() -> list[dict]:
    cases = []
    for algo, workers, ncn in itertools.product(ALGOS, (0, 2), (1, 4)):
        cases.append({"algo": algo, "workers": workers, "ncn": ncn, "seed": 123, "block": 50, "batch": 7,
                      "shuffle": 1})
    cases.append({"algo": "py1e", "workers": 2, "ncn": 2, "seed": 5, "block": 50, "batch": 7, "shuffle": 0})
    return cases


def sample_ids(samples: list[dict]) -> np.ndarray:
    return np.array([s["id"] for s in samples], dtype=np.int64)


def key(kind: str, case: dict) -> str:
    return "|".join([kind, *(f"{k}={v}" for k, v in case.items())])


def save(records: dict[str, np.ndarray], path: Path) -> None:
    """One int16 array of all orders of a kind, end to end, with their keys and shapes beside it (one file entry
    per order would make the file several times larger)."""
    packed = {}
    for kind in sorted({k.split("|")[0] for k in records}):
        names = [k for k in records if k.startswith(kind + "|")]
        flat = np.concatenate([records[k].reshape(-1) for k in names])
        assert np.array_equal(flat.astype(np.int16), flat)
        packed[f"{kind}_keys"] = np.array(names)
        packed[f"{kind}_shapes"] = np.array(json.dumps([records[k].shape for k in names]))
        packed[f"{kind}_flat"] = flat.astype(np.int16)
    np.savez_compressed(path, **packed)


def main() -> None:
    stand_in_torchvision()
    import streaming
    import torch
    from streaming.base.partition import get_partitions
    from streaming.base.shuffle import get_shuffle

    assert streaming.__version__ == "0.13.0", streaming.__version__
    records: dict[str, np.ndarray] = {}
    sizes = shard_sizes()
    for c in shuffle_cases():
        records[key("shuffle", c)] = get_shuffle(c["algo"], sizes, c["ncn"], c["seed"], c["epoch"], c["block"])
    for c in partition_cases():
        records[key("partition", c)] = get_partitions("relaxed", c["n"], c["ncn"], c["nodes"], c["ranks"],
                                                      c["workers"], c["batch"], c["drop"])
    fixture = HERE.parent / "fixtures" / "plain"
    for c in dataset_cases():
        with tempfile.TemporaryDirectory() as cache:
            ds = streaming.StreamingDataset(local=str(fixture), remote=None, batch_size=c["batch"],
                                            shuffle=bool(c["shuffle"]), shuffle_algo=c["algo"],
                                            shuffle_seed=c["seed"], shuffle_block_size=c["block"],
                                            num_canonical_nodes=c["ncn"])
            loader = torch.utils.data.DataLoader(ds, batch_size=c["batch"], num_workers=c["workers"],
                                                 collate_fn=sample_ids)
            records[key("dataset", c)] = np.concatenate(list(loader))
            del loader, ds
            streaming.base.util.clean_stale_shared_memory()
            del cache
    save(records, HERE / "mosaic_orders.npz")
    print(f"{len(records)} orders recorded")


if __name__ == "__main__":
    main()
