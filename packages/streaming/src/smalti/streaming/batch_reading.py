"""Sample and batch reading: the samples of some global ids from the cached shards, one reader call per shard,
and the fast batch path, which gathers each column of columnar shards straight into one tensor."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import get_worker_info

from smalti.streaming.bundles import Bundle
from smalti.streaming.cache import ShardCache
from smalti.streaming.sample_map import SampleMap

SAMPLE_HOOKS = ("__getitem__", "__getitems__", "__iter__")  # a subclass overriding one reads sample by sample


class Deferrer(Protocol):
    """Which shards another process of the node fetches (``FetchPlan.defer``): this one waits for its copy."""

    def defer(self, shard: int) -> bool: ...


@functools.lru_cache(maxsize=64)
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def bypasses_batch_path(cls: type, base: type) -> bool:
    """Whether ``cls`` (a subclass of the dataset class ``base``) changes samples in a way whole batches read
    straight from the shards would skip: a sample hook overridden, or ``transform_sample`` without
    ``transform_batch``."""

    def overridden(name: str) -> bool:
        return getattr(cls, name) is not getattr(base, name)

    return any(overridden(name) for name in SAMPLE_HOOKS) or \
        (overridden("transform_sample") and not overridden("transform_batch"))


def split_batch(batch: dict[str, torch.Tensor], sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    """``batch`` cut into consecutive batches of ``sizes`` samples (views, no copy)."""
    if len(sizes) == 1:
        return [batch]
    parts = {name: torch.split(t, sizes) for name, t in batch.items()}
    return [{name: p[i] for name, p in parts.items()} for i in range(len(sizes))]


class BatchReader:
    """Reads samples and columnar batches of global sample ids from a dataset's shard cache."""

    def __init__(self, table: SampleMap, cache: ShardCache) -> None:
        self.table, self.cache = table, cache

    def _reader(self, shard: int, plan: Deferrer | None, vouched: bool = False) -> Any:
        return self.cache.reader(shard, plan.defer(shard) if plan is not None else False, vouched=vouched)

    def gather(self, ids: np.ndarray, plan: Deferrer | None, transform: Callable[[Any], Any]) -> list[Any]:
        """The samples of global ids ``ids``, in order (one reader call per shard), each through ``transform``."""
        out: list[Any] = [None] * len(ids)
        for shard, pos, offs in self.table.groups(ids):
            for p, sample in zip(pos.tolist(), self._reader(shard, plan).gather(offs)):
                out[p] = transform(sample)
        return out

    def bundle(self, batches: list[np.ndarray], plan: Deferrer | None,
               make: Callable[[np.ndarray, Deferrer | None], Any]) -> Bundle:
        """A worker's :class:`Bundle` of ``batches`` (sample ids): references once their shards are local,
        checked and columnar; else the batches ``make`` makes here."""
        if not batches:
            return Bundle(refs=[])
        if self.columns(np.concatenate(batches), plan) is not None:
            return Bundle(refs=batches)
        return Bundle(batches=[make(ids, plan) for ids in batches])

    def columns(self, ids: np.ndarray, plan: Deferrer | None, vouched: bool = False,
                readers: dict[int, Any] | None = None) -> tuple[Any, ...] | None:
        """``(groups, column views per group, layout)`` of samples ``ids``; ``None`` when a shard is not
        columnar (see ``ShardReader.column_views``), the shards' columns differ, or a column is a uint64
        scalar (``default_collate`` refuses those: the per-sample path lets it say so). ``readers``: partial
        readers to use instead of the cache's for some shards (their rows are loaded here)."""
        groups = self.table.groups(ids)
        views, layout = [], None
        for shard, _, offs in groups:
            reader = readers.get(shard) if readers else None
            if reader is not None:
                reader.load_rows(offs)
            else:
                reader = self._reader(shard, plan, vouched)
            v = reader.column_views()
            if v is None or (layout is not None and reader.column_layout != layout):
                return None
            layout = reader.column_layout
            views.append(v)
        if any(dtype == np.uint64 and not shape for _, dtype, shape in layout):
            return None
        return groups, views, layout

    def collate_columns(self, ids: np.ndarray, plan: Deferrer | None, vouched: bool = False,
                        readers: dict[int, Any] | None = None) -> dict[str, torch.Tensor] | None:
        """The batch ``default_collate`` would make of samples ``ids``, built column by column; ``None`` when
        the shards are not columnar (see :meth:`columns`).

        Each column is gathered straight into one tensor (in shared memory inside a DataLoader worker, as
        ``default_collate`` does).
        """
        found = self.columns(ids, plan, vouched, readers)
        if found is None:
            return None
        groups, views, layout = found
        shared = get_worker_info() is not None
        batch = {}
        for name, dtype, shape in layout:
            out = torch.empty((len(ids), *shape), dtype=_torch_dtype(dtype))
            if shared:
                out.share_memory_()
            dst = out.numpy()
            if len(groups) == 1:
                np.take(views[0][name], groups[0][2], axis=0, out=dst)
            else:
                for (_, pos, offs), v in zip(groups, views):
                    dst[pos] = v[name][offs]
            batch[name] = out
        return batch
