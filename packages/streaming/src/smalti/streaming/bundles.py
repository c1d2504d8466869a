"""How a DataLoader worker's share of the epoch is cut into items: bundles of consecutive batches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


class Bundle:
    """Consecutive batches one DataLoader worker hands over as one item (see :meth:`StreamingDataset.iter_batches`).

    ``refs``: the global sample ids of each batch of columnar shards the worker has fetched, checked and
    opened, but not copied. :class:`StreamingDataLoader`'s main process copies those rows from its own
    mapping of the shard files (the page cache) straight into the batches' tensors
    (:meth:`StreamingDataset.resolve`): the data crosses no pipe and no shared-memory file and is copied
    once, and the DataLoader's fixed cost per item is paid once per bundle. ``batches``: batches the worker
    collated itself (shards that are not columnar).
    """

    __slots__ = ("refs", "batches")

    def __init__(self, refs: list[np.ndarray] | None = None, batches: list[Any] | None = None) -> None:
        self.refs, self.batches = refs, batches

    def __reduce__(self) -> tuple[Any, ...]:
        return Bundle, (self.refs, self.batches)


BUNDLE_SAMPLES = 512  # a worker hands over about this many samples per item (whole batches, at least one)


def _bundles(n_steps: int, worker_id: int, num_workers: int, cap: int) -> Iterator[tuple[int, int]]:
    """The step ranges ``[lo, hi)`` worker ``worker_id`` makes, in order.

    The steps are cut into consecutive bundles, bundle ``k`` going to worker ``k % num_workers`` (the order
    in which the DataLoader takes the workers' items): bundles of 1 step each for each worker's first one,
    then 2, 4, ... up to ``cap`` steps, so the first batches are not held back behind later ones.
    """
    if cap <= 1:
        for step in range(worker_id, n_steps, num_workers):
            yield step, step + 1
        return
    start, k = 0, 0
    while start < n_steps:
        size = min(cap, 1 << min(k // num_workers, 30), n_steps - start)
        if k % num_workers == worker_id:
            yield start, start + size
        start, k = start + size, k + 1
