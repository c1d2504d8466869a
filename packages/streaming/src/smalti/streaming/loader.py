"""``StreamingDataLoader``: a DataLoader that knows how far a :class:`StreamingDataset`'s epoch has gone.

DataLoader workers iterate copies of the dataset in other processes, so the dataset object the training loop
holds cannot see what was consumed. This loader counts the samples it hands to the loop, so
``loader.state_dict()`` (and ``dataset.state_dict()``) are exact with any number of workers, and it moves
the dataset to the next epoch when one is finished.
"""

from __future__ import annotations

import inspect
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from smalti.streaming.bundles import Bundle
from smalti.streaming.errors import StreamingError

if TYPE_CHECKING:  # the dataset imports this module (smalti_dataloader), never the other way round
    from smalti.streaming.dataset import StreamingDataset


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


class _Batches(IterableDataset):
    """A :class:`StreamingDataset` seen as a stream of whole batches (see :meth:`StreamingDataset.iter_batches`).

    Attributes it does not have itself (``state_dict``, ``set_epoch``, ``epoch``, ...) are the dataset's.
    """

    def __init__(self, dataset: StreamingDataset, collate_fn: Callable[[list[Any]], Any] | None,
                 drop_last: bool, bundles: bool) -> None:
        self.dataset, self.collate_fn, self.drop_last, self.bundles = dataset, collate_fn, drop_last, bundles

    def __iter__(self) -> Iterator[Any]:
        # a worker hands over bundles of references; the main process copies the rows from the page cache
        return self.dataset.iter_batches(self.collate_fn, self.drop_last,
                                         self.bundles and get_worker_info() is not None)

    def __len__(self) -> int:
        n, b = len(self.dataset), self.dataset.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "collate_fn", "drop_last", "bundles"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _as_is(batch: Any) -> Any:
    return batch


AF_UNIX_PATH_MAX = 107  # bytes of a socket path Linux accepts (sun_path is 108 with its NUL)


def worker_socket_path() -> str:
    """The longest socket path a DataLoader worker may listen on: multiprocessing passes file descriptors
    (shared-memory tensors) through ``$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX``."""
    import multiprocessing.process

    made = getattr(multiprocessing.process.current_process(), "_config", {}).get("tempdir")
    folder = made or os.path.join(tempfile.gettempdir(), "pymp-XXXXXXXX")
    return os.path.join(folder, "listener-XXXXXXXX")


def warn_if_worker_socket_path_too_long() -> None:
    """Warn when DataLoader workers' socket path would be too long: they would hang without a word."""
    path = worker_socket_path()
    size = len(os.fsencode(path))
    if size > AF_UNIX_PATH_MAX:
        warnings.warn(f"$TMPDIR is too long for DataLoader workers: they pass tensors through a socket at {path} "
                      f"({size} bytes), and Linux allows at most {AF_UNIX_PATH_MAX} bytes in a socket path, so "
                      "the workers would hang without an error. Set TMPDIR to a shorter folder (e.g. "
                      "TMPDIR=/tmp).", RuntimeWarning, stacklevel=3)


# what set_epoch / load_state_dict change in a dataset: the epoch, the resume point and the epoch plan
_ORDER_STATE = ("epoch", "_resume", "orders")
_LOADER_PARAMS = inspect.signature(DataLoader.__init__)
BATCHED_PREFETCH = 8  # items (batches or bundles) in flight per worker on the whole-batch path (torch's default: 2)


class StreamingDataLoader(DataLoader):
    """A :class:`~torch.utils.data.DataLoader` over a :class:`StreamingDataset` with ``state_dict`` support.

    When ``batch_size`` is the dataset's own (the usual case) and no sampler is given, batches are made whole,
    never sample by sample: with the default collation and fixed-size columns, one copy per column straight
    into the batch's tensors. With DataLoader workers (and no ``pin_memory``) a worker fetches, decompresses
    and checks the shards and hands over only the sample ids of several consecutive batches at once (a
    :class:`~smalti.streaming.dataset.Bundle`); this process then copies those rows from its own mapping of
    the shard files (the page cache) into the batches. Nothing but ids crosses the worker pipe, and the
    DataLoader's fixed cost per item is paid once per bundle. The batches are exactly those of a plain
    ``DataLoader(dataset, batch_size=dataset.batch_size, ...)``. ``loader.streaming_dataset`` is the dataset
    (``loader.dataset`` is then a batching view of it that forwards its attributes). Such a loader keeps
    :data:`BATCHED_PREFETCH` items in flight per worker unless ``prefetch_factor`` is given.
    """

    position_is_global = True  # its state_dict is the dataset's: valid on any data-parallel size

    def __init__(self, dataset: StreamingDataset, *args: Any, **kwargs: Any) -> None:
        if not callable(getattr(dataset, "transforms_samples", None)):
            raise StreamingError(f"StreamingDataLoader needs a StreamingDataset, got {type(dataset).__name__}")
        if kwargs.get("persistent_workers"):
            raise StreamingError("persistent_workers=True would keep each worker's copy of the dataset at its old "
                                 "epoch and position; leave it False")
        self.streaming_dataset = dataset
        bound = _LOADER_PARAMS.bind(None, dataset, *args, **kwargs)
        given = dict(bound.arguments)
        extra = given.pop("kwargs", {})
        given.pop("self")
        given.pop("dataset")
        if given.get("num_workers"):
            warn_if_worker_socket_path_too_long()
        batched = (given.get("batch_size", 1) == dataset.batch_size and given.get("sampler") is None
                   and given.get("batch_sampler") is None and not given.get("shuffle")
                   and not dataset.transforms_samples())
        if batched:
            if given.get("num_workers") and given.get("prefetch_factor") is None:
                # a batch costs a worker well under a millisecond: with torch's 2 in flight per worker, the
                # workers idle whenever the training process is not scheduled for a moment
                given["prefetch_factor"] = BATCHED_PREFETCH
            # pinned batches need tensors from the worker (the pin thread runs before __iter__ sees them);
            # bundles are made only with the default collation (a custom one runs in the worker)
            collate_fn = given.pop("collate_fn", None)
            view = _Batches(dataset, collate_fn, bool(given.pop("drop_last", False)),
                            bundles=collate_fn is None and not given.get("pin_memory"))
            given.update(batch_size=None, collate_fn=_as_is)
            super().__init__(view, **given, **extra)
        else:
            super().__init__(dataset, *args, **kwargs)
        self.batched = batched

    def _first_ids(self) -> np.ndarray | None:
        """The sample ids of this process's first batch when this process may make it itself (see
        :meth:`__iter__`): workers hand over bundles and the dataset warms its first shards up."""
        view = self.dataset
        if not (self.batched and self.num_workers and view.bundles and self.streaming_dataset.predownload > 0):
            return None
        ds = self.streaming_dataset
        ids = ds._first_batch_ids()  # the same ids the warm-up reads ahead (see WarmUp.take_readers)
        if ids is None or not len(ids) or (len(ids) < ds.batch_size and view.drop_last):
            return None
        return ids

    def __iter__(self) -> Iterator[Any]:
        ds = self.streaming_dataset
        epoch = ds.epoch
        ds._consumed = 0
        ds._counted_by_loader = True
        if self.num_workers:
            ds._order(epoch)  # once here, not in every worker: forked workers inherit it
        try:
            first = self._first_ids()
            # The first batch is made here, not by a worker, and handed out before the workers are started:
            # their start-up (two forks, 40-60 ms on 2 cores) would otherwise come before it, and it overlaps
            # the training loop's first step instead. The workers are still started from this thread (the
            # main one: torch watches them through its SIGCHLD handler there), on the next ``next()``. Worker
            # 0's first item, a bundle of just these ids, is then passed over.
            made = ds._first_batch(first) if first is not None else None
            if made is None:  # not columnar: the workers make every batch
                first = None
                items = super().__iter__()
            else:
                started_as = self._as_at_iter()
                ds._consumed += len(first)
                yield made
                items = self._start_workers(*started_as)
            for batch in items:
                if first is not None:
                    if type(batch) is not Bundle or batch.refs is None or len(batch.refs) != 1 or \
                            not np.array_equal(batch.refs[0], first):
                        raise StreamingError("the DataLoader's first item is not the first batch this process "
                                             "made: the dataset changed under the loader")
                    first = None
                    continue
                if type(batch) is Bundle:
                    made = ds.resolve(batch)
                    sizes = [len(r) for r in batch.refs] if batch.refs is not None else map(batch_len, made)
                    for one, n in zip(made, sizes):
                        ds._consumed += n
                        yield one
                    continue
                ds._consumed += batch_len(batch)
                yield batch
        finally:
            ds._counted_by_loader = False
        if ds.epoch == epoch:  # nobody called set_epoch meanwhile: the next pass is the next epoch
            ds._end_epoch(epoch)

    def _as_at_iter(self) -> tuple[torch.Generator, dict[str, Any]]:
        """What starting the workers at ``iter()`` would have used: the generator torch draws their base seed
        from, and the dataset's state that decides the epoch's order and where it starts. torch draws that
        seed from the loader's generator, or from the global one (the model's stream) when it has none: the
        generator is copied now and moved by that one draw, and the workers' start draws from the copy, so
        each stream moves exactly where it did when the workers started at ``iter()``."""
        source = self.generator
        generator = torch.Generator(device=source.device if source is not None else "cpu")
        generator.set_state(source.get_state() if source is not None else torch.get_rng_state())
        torch.empty((), dtype=torch.int64).random_(generator=source)
        ds = self.streaming_dataset
        return generator, {name: getattr(ds, name) for name in _ORDER_STATE}

    def _start_workers(self, generator: torch.Generator, position: dict[str, Any]) -> Iterator[Any]:
        """Start the workers (torch's iterator) on the epoch and with the seed of the ``iter()`` call that made
        the first batch, even if ``set_epoch`` or ``load_state_dict`` came in between (they do not reach
        the epoch in progress, as with workers started at once): the forked workers copy this state."""
        ds = self.streaming_dataset
        now = {name: getattr(ds, name) for name in _ORDER_STATE}
        own = self.generator
        try:
            for name, value in position.items():
                setattr(ds, name, value)
            self.generator = generator
            return super().__iter__()
        finally:
            self.generator = own
            for name, value in now.items():
                setattr(ds, name, value)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's position after the batches this loader has handed out."""
        return self.streaming_dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the dataset at ``state`` (from :meth:`state_dict`)."""
        self.streaming_dataset.load_state_dict(state)
