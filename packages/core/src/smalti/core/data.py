"""Train and eval dataloaders: per-rank batch from a global batch, a sampler that resumes mid-epoch.

Data loading never draws from torch's global generator: that stream belongs to the model (dropout, router
jitter), and a checkpoint restores it exactly. A ``DataLoader`` left with ``generator=None`` takes its workers'
base seed (and a ``RandomSampler`` its permutation) from the global stream at every ``iter()``, so a run resumed
from a checkpoint would see the model's random numbers shifted by that draw. :func:`seed_data_loading` gives
the loader a generator of its own, seeded from the run seed and the epoch.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler

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


#: A dataset's method that builds its own DataLoader from :func:`build_dataloader`'s options (``batch_size``,
#: ``num_workers``, ``collate_fn``, ``drop_last`` and any other DataLoader keyword). A duck-typed protocol, so
#: smalti-core needs no import of the package that defines the dataset (smalti-streaming's StreamingDataset).
DATALOADER_METHOD = "smalti_dataloader"

#: A loader's or dataset's attribute: ``True`` when its ``state_dict`` is a position in the epoch's global order
#: (samples consumed over all data-parallel ranks), the same on every rank and valid on any data-parallel size.
#: Its checkpoint then resumes on another number of ranks (smalti-streaming's datasets and loader set it).
GLOBAL_POSITION = "position_is_global"

#: A dataset's method returning a short phrase on how its rows came to be (``"64 examples read from chat.jsonl,
#: packed into 3 rows of max_seq_len=2048 tokens"``), quoted when the rows make no batch. Duck-typed and optional.
SIZE_METHOD = "describe_size"

#: Set on a DataLoader whose generator smalti made, so the trainer may reseed it (a user's own is left alone).
_OWNED = "_smalti_owns_generator"


def data_seed(seed: int, epoch: int, stream: str = "train") -> int:
    """The seed of data loading's own generator for ``epoch`` of a run seeded ``seed`` (63 bits, well mixed).

    Hashed rather than ``seed + epoch``, so it never equals a seed the model's stream was given.
    """
    digest = hashlib.blake2b(f"smalti-data/{stream}/{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seed_data_loading(loader: Any, seed: int, epoch: int, stream: str = "train") -> None:
    """Make ``loader`` draw its random numbers from a generator of its own, seeded by ``(seed, epoch)``.

    Called by the trainer before each epoch (and each evaluation). A ``DataLoader`` without a generator gets
    one (shared with its ``RandomSampler`` when that has none), so ``iter(loader)`` leaves torch's global
    generator, the model's stream, untouched; one smalti made is reseeded, so epoch ``e`` of a resumed run
    loads as epoch ``e`` of an uninterrupted one. A generator the user passed is theirs and is not reseeded.
    Anything that is not a ``DataLoader`` is left as it is.
    """
    if not isinstance(loader, DataLoader):
        return
    if loader.generator is None:
        loader.generator = torch.Generator()
        setattr(loader, _OWNED, True)
        sampler = loader.sampler
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            sampler.generator = loader.generator
    if getattr(loader, _OWNED, False):
        loader.generator.manual_seed(data_seed(seed, epoch, stream))


def per_rank_batch_size(
    global_batch_size: int, dp_world_size: int, what: str = "global_train_batch_size"
) -> int:
    """``global_batch_size / dp_world_size``; raise naming the key when it does not divide evenly."""
    if global_batch_size % dp_world_size:
        raise ConfigError(
            f"{what}={global_batch_size} does not divide over {dp_world_size} data-parallel ranks; "
            f"use a multiple of {dp_world_size}"
        )
    return global_batch_size // dp_world_size


def check_has_batches(loader: Any, global_batch_size: int, dp_world_size: int, key: str = "data.train",
                      batch_key: str = "data.global_train_batch_size") -> None:
    """Raise a :class:`ConfigError` with the numbers when ``loader`` yields no batch (before any model is built).

    The message gives the rows the dataset holds (and how they came to be, from its ``describe_size()``), the
    global batch size, the data-parallel world size and what to change. A loader without a length passes.
    """
    try:
        batches = len(loader)
    except TypeError:
        return
    if batches:
        return
    rows, how, held = _rows_held(loader)
    per_rank = max(1, global_batch_size // max(1, dp_world_size))
    fits = f"at most {rows - rows % dp_world_size}" if rows and rows >= dp_world_size else "more rows"
    raise ConfigError(
        f"{key} has no full batch: {held}, but {batch_key}={global_batch_size} over {dp_world_size} "
        f"data-parallel rank(s) needs {per_rank} per rank; set {batch_key} to {fits}, give more data"
        + (", or shorter rows (a smaller max_seq_len packs fewer tokens per row)" if "max_seq_len" in how else "")
        + (", or data.drop_last=false" if getattr(loader, "drop_last", False) else "")
    )


def _rows_held(loader: Any) -> tuple[int | None, str, str]:
    """The rows ``loader``'s dataset holds (None without a length), how they came to be, and both as a phrase."""
    dataset = getattr(loader, "dataset", loader)
    try:
        rows = len(dataset)
    except TypeError:
        rows = None
    describe = getattr(dataset, SIZE_METHOD, None)
    how = f" ({describe()})" if callable(describe) else ""
    return rows, how, f"{rows} rows{how}" if rows is not None else f"a dataset{how}"


def no_batch_message(loader: Any, dp_world_size: int) -> str:
    """Why a dataloader handed to the :class:`~smalti.core.Trainer` yields no batch, with its numbers.

    The Python-API counterpart of :func:`check_has_batches`: the rows of its dataset, the loader's per-rank
    ``batch_size`` and ``drop_last``, the data-parallel world size, and what to change.
    """
    rows, _, held = _rows_held(loader)
    batch_size = getattr(loader, "batch_size", None)
    drop_last = getattr(loader, "drop_last", False)
    if batch_size is None:
        return f"the train dataloader has no batches: its dataset holds {held}; check its path, size and batch size"
    fits = f"at most {rows // max(1, dp_world_size)}" if rows else "more rows"
    return (
        f"the train dataloader has no batches: its dataset holds {held}, split over {dp_world_size} data-parallel "
        f"rank(s), and its batch_size={batch_size} per rank with drop_last={drop_last}; set batch_size to {fits}, "
        "give more data" + (", or drop_last=False" if drop_last else "")
    )


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
    themselves over ranks. An iterable dataset with a ``smalti_dataloader(**loader_kwargs)`` method builds its
    own loader (see :data:`DATALOADER_METHOD`; smalti-streaming's ``StreamingDataset`` returns its
    ``StreamingDataLoader``, whose ``state_dict`` the trainer then checkpoints). The loader draws from its own
    generator (see :func:`seed_data_loading`), never from torch's global one.
    """
    if isinstance(dataset, DataLoader):
        return dataset
    if isinstance(dataset, IterableDataset):
        if getattr(dataset, "batch_size", None) != batch_size and hasattr(dataset, "batch_size"):
            # Streaming datasets split global batches themselves and must know the per-rank batch size.
            dataset.batch_size = batch_size
        options = dict(
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate_fn,
            drop_last=drop_last,
            **kwargs,
        )
        make = getattr(dataset, DATALOADER_METHOD, None)
        loader = make(**options) if callable(make) else DataLoader(dataset, **options)
        if not isinstance(loader, DataLoader):
            raise ConfigError(
                f"{type(dataset).__name__}.{DATALOADER_METHOD}() returned {type(loader).__name__}, "
                "not a torch DataLoader"
            )
    else:
        sampler = ResumableDistributedSampler(
            dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            drop_last=drop_last,
            persistent_workers=False,
            **kwargs,
        )
    seed_data_loading(loader, seed, 0)
    return loader
