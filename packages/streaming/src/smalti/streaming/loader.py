"""``StreamingDataLoader``: a DataLoader that knows how far a :class:`StreamingDataset`'s epoch has gone.

DataLoader workers iterate copies of the dataset in other processes, so the dataset object the training loop
holds cannot see what was consumed. This loader counts the samples it hands to the loop, so
``loader.state_dict()`` (and ``dataset.state_dict()``) are exact with any number of workers, and it moves
the dataset to the next epoch when one is finished.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from smalti.streaming.dataset import StreamingDataset
from smalti.streaming.errors import StreamingError


def batch_len(batch: Any) -> int:
    """Samples in a collated batch: the length of a tensor, or of the first value of a mapping or sequence."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        return batch_len(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        first = batch[0] if batch else None
        if isinstance(first, torch.Tensor | Mapping) or (isinstance(first, Sequence) and not isinstance(first, str)):
            return batch_len(first)
        return len(batch)
    return 1


class StreamingDataLoader(DataLoader):
    """A :class:`~torch.utils.data.DataLoader` over a :class:`StreamingDataset` with ``state_dict`` support."""

    def __init__(self, dataset: StreamingDataset, *args: Any, **kwargs: Any) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise StreamingError(f"StreamingDataLoader needs a StreamingDataset, got {type(dataset).__name__}")
        if kwargs.get("persistent_workers"):
            raise StreamingError("persistent_workers=True would keep each worker's copy of the dataset at its old "
                                 "epoch and position; leave it False")
        super().__init__(dataset, *args, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        ds: StreamingDataset = self.dataset  # type: ignore[assignment]
        epoch = ds.epoch
        ds._consumed = 0
        ds._counted_by_loader = True
        try:
            for batch in super().__iter__():
                ds._consumed += batch_len(batch)
                yield batch
        finally:
            ds._counted_by_loader = False
        if ds.epoch == epoch:  # nobody called set_epoch meanwhile: the next pass is the next epoch
            ds._end_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's position after the batches this loader has handed out."""
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the dataset at ``state`` (from :meth:`state_dict`)."""
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]
