"""An epoch's order as the dataset reads it: global batches by position, computed whole or when needed.

Two kinds of order answer the same questions (the ids of some columns of some global batches, the ids at
some global positions): :class:`ArrayOrder` holds the whole padded epoch as one array (mosaicml-streaming's
shuffles, curricula that change the mix mid-epoch, the non-random batching methods), :class:`LazyOrder`
computes them from a :class:`~smalti.streaming.order_blocks.BlockOrder` (or its ``keyed`` kind), in memory that grows with shards,
not samples. :class:`Remaining` is what is left of an epoch after a resume position (any global sample
count, not only a whole number of global batches), cut again into global batches; :class:`RowsAhead` reads
one rank's columns of them a window of steps at a time, as the iteration asks for them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from smalti.streaming.order_blocks import BlockOrder


class EpochOrder(Protocol):
    """One epoch's order: ``length`` samples in a sequence that does not depend on the global batch, read in
    global batches of ``global_batch`` from any start position, each batch grouped by canonical node and the
    last one padded with the sequence's first samples."""

    length: int  # samples in the sequence
    size: int  # ... padded to whole global batches
    global_batch: int

    def window(self, start: int, k0: int, k1: int, c0: int, c1: int) -> np.ndarray:
        """Ids of columns ``[c0, c1)`` of the global batches ``[k0, k1)`` that begin ``start`` samples into the
        epoch, one row each."""

    def full(self) -> np.ndarray:
        """The whole order from the start, padded, as one array."""


def _grouped(g: np.ndarray, nodes: np.ndarray, global_batch: int, start: int) -> np.ndarray:
    """The permutation of positions ``g`` (whole global batches from ``start``) that puts each batch's samples
    of canonical node 0 first, then node 1, ... keeping their order (see ``order.group_by_node``); a node of
    ``-1`` (past the padded end) goes last."""
    top = int(nodes.max(initial=0)) + 1
    key = (g - start) // global_batch * (top + 1) + np.where(nodes < 0, top, nodes)
    return np.argsort(key, kind="stable")


class ArrayOrder:
    """An epoch order held whole: ``order`` (unpadded) and each sample's canonical node ``nodes``; without
    nodes, ``order`` is whole global batches read as they are (the batching methods that keep streams apart)."""

    def __init__(self, order: np.ndarray, nodes: np.ndarray | None, global_batch: int) -> None:
        self.order, self.global_batch = order.astype(np.int64, copy=False), global_batch
        self.nodes = None if nodes is None else nodes.astype(np.int32)
        self.length = len(order)
        self.size = -(-self.length // global_batch) * global_batch  # padded

    def window(self, start: int, k0: int, k1: int, c0: int, c1: int) -> np.ndarray:
        G, n = self.global_batch, self.length
        g = np.arange(start + k0 * G, start + k1 * G, dtype=np.int64)
        if self.nodes is None:
            ids = np.full(len(g), -1, dtype=np.int64)
            inside = g < n
            ids[inside] = self.order[g[inside]]
            return ids.reshape(-1, G)[:, c0:c1]
        if not n:
            return np.zeros((0, c1 - c0), dtype=np.int64)
        inside = g < self.size  # past the padded end (a resume off this layout's batches): -1
        at = g % n  # past the end: the padding, the sequence's first samples again
        nodes = np.where(inside, self.nodes[at], -1)
        ids = np.where(inside, self.order[at], -1)
        by_node = _grouped(g, nodes, G, start)
        return ids[by_node].reshape(-1, G)[:, c0:c1]

    def full(self) -> np.ndarray:
        G = self.global_batch
        return self.window(0, 0, self.size // G, 0, G).reshape(-1)


class LazyOrder:
    """A ``blocks`` or ``keyed`` order (:class:`~smalti.streaming.order_blocks.BlockOrder`), never materialised."""

    def __init__(self, blocks: BlockOrder) -> None:
        self.blocks, self.global_batch, self.length = blocks, blocks.global_batch, blocks.num_samples
        self.size = blocks.padded_size

    def window(self, start: int, k0: int, k1: int, c0: int, c1: int) -> np.ndarray:
        G = self.global_batch
        if start % G == 0:
            return self.blocks.grid(start // G + k0, start // G + k1, c0, c1)
        return self.blocks.shifted_grid(start, k0, k1, c0, c1)

    def full(self) -> np.ndarray:
        return self.blocks.full()


class Remaining:
    """The global batches of ``order`` after its first ``start`` samples, one row each; ``-1`` fills the last
    past the padded end, when ``start`` is no whole number of global batches.

    The first ``start`` samples of the sequence are the ones consumed, whatever global batch they were read
    in: a checkpoint taken at a whole number of global batches on one data-parallel size resumes on any other
    (a batch is grouped by node only inside itself). Row ``k`` costs the same wherever it is in the epoch.
    """

    def __init__(self, order: EpochOrder, start: int = 0) -> None:
        self.order, self.start = order, max(int(start), 0)
        self._count = max(-(-(order.size - self.start) // order.global_batch), 0)

    def __len__(self) -> int:
        return self._count

    def rows(self, k0: int, k1: int, c0: int = 0, c1: int | None = None) -> np.ndarray:
        """Ids of columns ``[c0, c1)`` of remaining global batches ``[k0, k1)``."""
        c1 = self.order.global_batch if c1 is None else c1
        k0, k1 = max(k0, 0), min(k1, self._count)
        if k1 <= k0:
            return np.zeros((0, c1 - c0), dtype=np.int64)
        return self.order.window(self.start, k0, k1, c0, c1)


class GridRemaining:
    """Remaining global batches given whole as rows, ``-1`` padding (mosaicml-streaming's partition, which
    places its own resume position: see :mod:`smalti.streaming.order_mosaic`)."""

    def __init__(self, grid: np.ndarray) -> None:
        self.grid = grid

    def __len__(self) -> int:
        return len(self.grid)

    def rows(self, k0: int, k1: int, c0: int = 0, c1: int | None = None) -> np.ndarray:
        """Ids of columns ``[c0, c1)`` of remaining global batches ``[k0, k1)``."""
        return self.grid[max(k0, 0) : max(k1, 0), c0:c1]


ROWS_AHEAD_SAMPLES = 16384  # one rank's ids computed per call to the order while iterating (128 KB)


class RowsAhead:
    """One rank's columns ``[c0, c1)`` of ``remaining``'s global batches, asked for in increasing step ranges
    (a DataLoader worker's batches or bundles) and computed a window of about ``samples`` ids at a time.

    A lazy order pays a fixed cost per call whatever the number of ids (a block's keys, cycle walking, the
    interleave's tables), which asking for each batch alone paid for every few dozen samples; a window
    spreads it over ``samples`` ids (figures in the streaming README). A worker also computes its peers'
    steps inside its window, a cheap vectorised pass, and the rows are exactly those asked one by one.
    """

    def __init__(self, remaining: Remaining | GridRemaining, c0: int, c1: int,
                 samples: int = ROWS_AHEAD_SAMPLES) -> None:
        self.remaining, self.c0, self.c1 = remaining, c0, c1
        self.steps = max(1, samples // max(c1 - c0, 1))
        self._lo = 0
        self._rows = np.zeros((0, c1 - c0), dtype=np.int64)

    def rows(self, k0: int, k1: int) -> np.ndarray:
        """Columns ``[c0, c1)`` of remaining global batches ``[k0, k1)``, as ``remaining.rows`` gives them."""
        k0, k1 = max(k0, 0), min(k1, len(self.remaining))
        if k1 <= k0:
            return np.zeros((0, self.c1 - self.c0), dtype=np.int64)
        if k0 < self._lo or k1 > self._lo + len(self._rows):
            self._lo = k0
            self._rows = self.remaining.rows(k0, max(k1, k0 + self.steps), self.c0, self.c1)
        return self._rows[k0 - self._lo : k1 - self._lo]
