"""Train and eval dataloaders: per-rank batch from a global batch, a sampler that resumes mid-epoch."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from smalti.core.errors import ConfigError

log = logging.getLogger(__name__)


class ResumableDistributedSampler(Sampler[int]):
    """A distributed sampler (shuffled per epoch from ``seed``) that can start part-way through an epoch.

    Each rank takes every ``num_replicas``-th index of the epoch's permutation; ``set_epoch`` picks the
    permutation and ``skip`` drops the first indices of this rank's share, so resuming at batch ``b``
    costs nothing instead of replaying ``b`` batches.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.dataset_len = len(dataset)  # type: ignore[arg-type]
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0
        if drop_last:
            self.num_samples = self.dataset_len // num_replicas
        else:
            self.num_samples = math.ceil(self.dataset_len / num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation and start from its beginning."""
        self.epoch = epoch
        self.start = 0

    def skip(self, num_indices: int) -> None:
        """Start this epoch after the first ``num_indices`` indices of this rank's share."""
        self.start = num_indices

    def _indices(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_len, generator=gen).tolist()
        else:
            indices = list(range(self.dataset_len))
        total = self.num_samples * self.num_replicas
        if total > len(indices):
            indices += indices[: total - len(indices)]
        return indices[:total][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start :])

    def __len__(self) -> int:
        return self.num_samples - self.start


def per_rank_batch_size(global_batch_size: int, dp_world_size: int, what: str = "global_train_batch_size") -> int:
    """``global_batch_size / dp_world_size``; raise naming the key when it does not divide evenly."""
    if global_batch_size % dp_world_size:
        raise ConfigError(
            f"{what}={global_batch_size} does not divide over {dp_world_size} data-parallel ranks; "
            f"use a multiple of {dp_world_size}"
        )
    return global_batch_size // dp_world_size


def build_dataloader(
    dataset: Dataset | DataLoader,
    batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **kwargs: Any,
) -> DataLoader:
    """A DataLoader over ``dataset`` for this rank (a ready DataLoader is returned unchanged).

    Map-style datasets get a :class:`ResumableDistributedSampler`; iterable datasets (streaming) split
    themselves over ranks.
    """
    if isinstance(dataset, DataLoader):
        return dataset
    if isinstance(dataset, IterableDataset):
        if getattr(dataset, "batch_size", None) != batch_size and hasattr(dataset, "batch_size"):
            # Streaming datasets split global batches themselves and must know the per-rank batch size.
            dataset.batch_size = batch_size
        return DataLoader(
            dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn, drop_last=drop_last, **kwargs
        )
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        drop_last=drop_last,
        persistent_workers=False,
        **kwargs,
    )
