"""``Stream`` and ``StreamingDataset``: MDS data from local disk or remote storage, shuffled, split and resumable."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from smalti.streaming.cache import ShardCache
from smalti.streaming.errors import StreamingError
from smalti.streaming.mds import INDEX, load_index, parse_size
from smalti.streaming.order import (
    group_by_node,
    pad_to_batches,
    select_samples,
    sequential_order,
    shuffle_order,
    stream_counts,
)
from smalti.streaming.storage import download_file

log = logging.getLogger(__name__)

BATCHING_METHODS = ("random", "stratified", "per_stream", "device_per_stream")


@dataclass
class Stream:
    """One MDS dataset: ``remote`` (URL or path, optional) cached into ``local``, with one mixing weight.

    ``proportion`` is relative to the other streams; ``repeat`` (times per epoch) and ``choose`` (samples per
    epoch) are absolute. Give at most one.
    """

    remote: str | None = None
    local: str | None = None
    split: str | None = None
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("proportion", "repeat", "choose") if getattr(self, k) is not None]
        if len(given) > 1:
            raise StreamingError(f"stream {self.remote or self.local}: give one of proportion/repeat/choose, not {given}")
        if self.remote is None and self.local is None:
            raise StreamingError("a stream needs remote, local or both")
        if self.local is None:
            import hashlib
            import tempfile

            tag = hashlib.sha1(str(self.remote).encode()).hexdigest()[:16]
            self.local = os.path.join(tempfile.gettempdir(), "smalti-streaming", tag)

    @property
    def weight(self) -> tuple[str, float | int | None]:
        for kind in ("proportion", "repeat", "choose"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return "none", None

    def local_dir(self) -> Path:
        return Path(self.local) / self.split if self.split else Path(self.local)

    def remote_path(self, name: str) -> str | None:
        if self.remote is None:
            return None
        parts = [self.remote.rstrip("/")] + ([self.split] if self.split else []) + [name]
        return "/".join(parts) if "://" in self.remote else os.path.join(*parts)

    @property
    def name(self) -> str:
        return str(self.remote or self.local)


def _world() -> tuple[int, int, int, int]:
    """``(rank, world size, local rank, local world size)`` from the process group or torchrun's environment."""
    import torch.distributed as dist

    env = os.environ
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    return rank, world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))


class StreamingDataset(IterableDataset):
    """Streams samples from MDS shards; also supports ``len()`` (this rank's samples per epoch) and ``ds[i]``.

    Each rank reads ``batch_size`` samples of every global batch; the global batches depend only on the
    seed, ``num_canonical_nodes`` and ``batch_size * data-parallel ranks`` (see :mod:`smalti.streaming.order`).
    ``rank``/``world_size`` default to the process group or torchrun's environment. Call :meth:`set_epoch`
    before each epoch (smalti's trainer does; iterating in-process or through
    :class:`~smalti.streaming.StreamingDataLoader` also advances it). :meth:`state_dict` /
    :meth:`load_state_dict` resume mid-epoch without replaying it.
    """

    def __init__(
        self,
        *,
        streams: list[Stream] | None = None,
        remote: str | None = None,
        local: str | None = None,
        split: str | None = None,
        batch_size: int | None = None,
        shuffle: bool = False,
        shuffle_algo: str = "py1e",
        shuffle_seed: int = 9176,
        shuffle_block_size: int | None = None,
        num_canonical_nodes: int | None = None,
        partition_algo: str = "orig",
        batching_method: str = "random",
        epoch_size: int | None = None,
        cache_limit: int | str | None = None,
        predownload: int | None = None,
        replication: int | None = None,
        download_retry: int = 2,
        download_timeout: float = 60.0,
        validate_hash: bool = True,
        allow_unsafe_types: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        proportion_schedule: list[dict[str, Any]] | None = None,
    ) -> None:
        if streams is None:
            if remote is None and local is None:
                raise StreamingError("give streams=[Stream(...)] or remote/local")
            streams = [Stream(remote=remote, local=local, split=split)]
        elif remote is not None or local is not None:
            raise StreamingError("give either streams or remote/local, not both")
        streams = [Stream(**dict(s)) if isinstance(s, Mapping) else s for s in streams]  # mappings from YAML
        if batching_method not in BATCHING_METHODS:
            raise StreamingError(f"batching_method={batching_method!r} is not one of {', '.join(BATCHING_METHODS)}")
        if partition_algo not in ("orig", "relaxed"):
            raise StreamingError(f"partition_algo={partition_algo!r} must be 'orig' or 'relaxed' (both give the "
                                 "same topology-independent global batches here)")
        self.streams = streams
        env_rank, env_world, local_rank, local_world = _world()
        explicit = rank is not None or world_size is not None
        self.rank = env_rank if rank is None else rank
        self.world_size = env_world if world_size is None else world_size
        # Processes that share this node's cache directory split the downloads (see smalti.streaming.cache).
        self.local_rank, self.local_world = (0, 1) if explicit else (local_rank, local_world)
        if not 0 <= self.rank < self.world_size:
            raise StreamingError(f"rank={self.rank} is not in a world of {self.world_size}")
        self.replication = replication or 1
        if self.world_size % self.replication:
            raise StreamingError(f"replication={self.replication} must divide the world size {self.world_size}")
        self.dp_world = self.world_size // self.replication
        self.dp_rank = self.rank // self.replication
        if batch_size is not None and batch_size < 1:
            raise StreamingError(f"batch_size={batch_size} must be a positive number of samples per rank")
        self.batch_size = batch_size or 1
        self.shuffle, self.shuffle_algo, self.shuffle_seed = shuffle, shuffle_algo, shuffle_seed
        self.shuffle_block_size = shuffle_block_size
        self.num_canonical_nodes = num_canonical_nodes or 1
        self.batching_method = batching_method
        self.epoch_size = epoch_size
        self.predownload = 8 * self.batch_size if predownload is None else predownload
        self.download_retry, self.download_timeout = download_retry, download_timeout
        self.validate_hash = validate_hash
        self.allow_unsafe_types = allow_unsafe_types
        self.proportion_schedule = self._check_schedule(proportion_schedule or [], len(streams))
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, global samples already consumed in it)
        self._consumed = 0  # samples this process handed out in the current epoch (this rank's share)
        self._counted_by_loader = False
        self._order_cache: dict[tuple[Any, ...], np.ndarray] = {}
        shards: list[tuple[int, dict[str, Any]]] = []  # (stream index, index entry)
        self._stream_shards: list[list[int]] = []
        for si, stream in enumerate(streams):
            ids = []
            for entry in self._load_stream_index(stream):
                ids.append(len(shards))
                shards.append((si, entry))
            self._stream_shards.append(ids)
        self._shards = shards
        sizes = np.array([entry["samples"] for _, entry in shards], dtype=np.int64)
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_samples = int(self._shard_starts[-1])
        if self.num_samples == 0:
            raise StreamingError(f"streams {[s.name for s in streams]} hold no samples")
        self.cache_limit = parse_size(cache_limit) if cache_limit is not None else None
        if self.cache_limit is not None:
            largest = max((e["raw_data"]["bytes"] + ((e.get("zip_data") or {}).get("bytes") or 0)) for _, e in shards)
            if self.cache_limit < largest:
                raise StreamingError(f"cache_limit={self.cache_limit} bytes is smaller than the largest shard "
                                     f"({largest} bytes with its zip); raise cache_limit")
        self.cache = ShardCache(streams, shards, self.cache_limit, download_retry, download_timeout, validate_hash)

    @staticmethod
    def _check_schedule(schedule: list[dict[str, Any]], num_streams: int) -> list[tuple[int, list[float]]]:
        """``[{"at": "2ep", "proportions": [1, 3]}, ...]`` -> sorted ``(epoch, proportions)``."""
        out = []
        for item in schedule:
            at = str(item.get("at", ""))
            if not at.endswith("ep") or not at[:-2].isdigit():
                raise StreamingError(f"proportion_schedule: 'at' must be a whole number of epochs like '2ep', got {at!r}")
            props = [float(p) for p in item.get("proportions", [])]
            if len(props) != num_streams or min(props, default=0) < 0 or not sum(props):
                raise StreamingError(f"proportion_schedule at {at}: give {num_streams} non-negative proportions, "
                                     f"got {item.get('proportions')}")
            out.append((int(at[:-2]), props))
        return sorted(out)

    def weights_for_epoch(self, epoch: int) -> list[tuple[str, float | int | None]]:
        """The streams' weights in ``epoch``: their own, or the latest ``proportion_schedule`` entry reached."""
        chosen = None
        for start, props in self.proportion_schedule:
            if epoch >= start:
                chosen = props
        if chosen is None:
            return [s.weight for s in self.streams]
        return [("proportion", p) for p in chosen]

    # ------------------------------------------------------------------ index and shards

    def _load_stream_index(self, stream: Stream) -> list[dict[str, Any]]:
        local = stream.local_dir() / INDEX
        remote = stream.remote_path(INDEX)
        if remote is not None and not local.exists():
            download_file(remote, local, self.download_retry, self.download_timeout)
        if not local.exists():
            raise StreamingError(f"stream {stream.name}: no {INDEX} at {local} and no remote to fetch it from")
        entries = load_index(local)
        for entry in entries:
            if "pkl" in entry["column_encodings"] and not self.allow_unsafe_types:
                raise StreamingError(f"stream {stream.name} has a 'pkl' column, which can run code when read; "
                                     "pass allow_unsafe_types=True if you trust it")
        return entries

    def _locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard and offset in it of each global sample id."""
        shards = np.searchsorted(self._shard_starts, samples, side="right") - 1
        return shards, samples - self._shard_starts[shards]

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index`` of the whole dataset (all streams, in shard order)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range for {self.num_samples} samples")
        shards, offsets = self._locate(np.array([index]))
        return self.cache.reader(int(shards[0]))[int(offsets[0])]

    # ------------------------------------------------------------------ epochs

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on."""
        if epoch != self.epoch:
            self._consumed = 0
        self.epoch = epoch

    def _shard_ids(self, shards: list[int]) -> list[np.ndarray]:
        return [np.arange(self._shard_starts[s], self._shard_starts[s + 1]) for s in shards]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch``, padded to whole global batches (a pure function of the settings)."""
        global_batch = self.batch_size * self.dp_world
        key = (epoch, global_batch, self.batching_method, self.shuffle, self.shuffle_algo, self.shuffle_seed,
               self.shuffle_block_size, self.num_canonical_nodes, self.epoch_size)
        order = self._order_cache.get(key)
        if order is None:
            order = self._compute_order(epoch, global_batch)
            order.setflags(write=False)
            self._order_cache = {key: order}
        return order

    def _compute_order(self, epoch: int, global_batch: int) -> np.ndarray:
        sizes = [sum(self._shards[s][1]["samples"] for s in ids) for ids in self._stream_shards]
        counts = stream_counts(sizes, self.weights_for_epoch(epoch), self.epoch_size, self.shuffle_seed + epoch)
        per_stream = [select_samples(self._shard_ids(ids), n, self.shuffle_seed + 1000 * si, epoch)
                      for si, (ids, n) in enumerate(zip(self._stream_shards, counts))]

        def order_of(shards: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            if not self.shuffle:
                return sequential_order(shards, self.num_canonical_nodes)
            return shuffle_order(shards, self.shuffle_algo, self.shuffle_seed, epoch, self.num_canonical_nodes,
                                 self.shuffle_block_size)

        if self.batching_method == "random" or len(self.streams) == 1:
            order, nodes = order_of([s for shards in per_stream for s in shards])
            padded = pad_to_batches(order, global_batch)
            return group_by_node(padded, pad_to_batches(nodes, global_batch), global_batch)
        orders = [order_of(shards)[0] for shards in per_stream]
        rng = np.random.default_rng(self.shuffle_seed + epoch)
        if self.batching_method == "stratified":
            share = np.array([len(o) for o in orders], dtype=np.float64)
            per_batch = np.floor(share / share.sum() * global_batch).astype(int)
            for i in np.argsort(-(share / share.sum() * global_batch - per_batch))[: global_batch - per_batch.sum()]:
                per_batch[i] += 1
            n_batches = min(len(o) // c for o, c in zip(orders, per_batch) if c) if per_batch.any() else 0
            batches = [np.concatenate([o[b * c : (b + 1) * c] for o, c in zip(orders, per_batch)])
                       for b in range(n_batches)]
            return np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
        chunk = global_batch if self.batching_method == "per_stream" else self.batch_size
        chunks = [o[i : i + chunk] for o in orders for i in range(0, len(o) - chunk + 1, chunk)]
        chunks = [chunks[i] for i in rng.permutation(len(chunks))]
        usable = len(chunks) - len(chunks) % (global_batch // chunk)
        return np.concatenate(chunks[:usable]) if usable else np.zeros(0, dtype=np.int64)

    def _remaining_grid(self, epoch: int) -> np.ndarray:
        """The epoch's global batches still to come, one row each; ``-1`` pads a partial last batch."""
        global_batch = self.batch_size * self.dp_world
        order = self.epoch_order(epoch)
        drop = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        if drop:
            order = order[drop:]
            order = np.concatenate([order, np.full((-len(order)) % global_batch, -1, dtype=np.int64)])
        return order.reshape(-1, global_batch)

    def __len__(self) -> int:
        """Samples this rank yields per epoch (including the padding of the last global batch)."""
        return len(self.epoch_order(self.epoch)) // self.dp_world

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        epoch = self.epoch
        grid = self._remaining_grid(epoch)
        b = self.batch_size
        # This worker yields the rank's batches worker_id, worker_id + num_workers, ... (global batch steps).
        steps = np.arange(worker_id, len(grid), num_workers)
        mine = grid[steps, self.dp_rank * b : (self.dp_rank + 1) * b]
        step_of = np.repeat(steps, b)
        flat = mine.reshape(-1)
        keep = flat >= 0
        flat, step_of = flat[keep], step_of[keep]
        shard_of, offset_of = self._locate(flat)
        plan = _FetchPlan(self, grid, worker_id, num_workers)
        if worker is None:
            self._consumed = 0
        try:
            for shard, offset, step in zip(shard_of.tolist(), offset_of.tolist(), step_of.tolist()):
                plan.progress = step
                item = self.cache.reader(shard, plan.defer(shard))[offset]
                if not self._counted_by_loader:
                    self._consumed += 1
                yield item
            plan.finish()
        finally:
            plan.stop()
        if worker is None and self.epoch == epoch:
            self._end_epoch(epoch)

    def _end_epoch(self, epoch: int) -> None:
        self.epoch = epoch + 1
        self._consumed = 0
        if self._resume and self._resume[0] <= epoch:
            self._resume = None

    # ------------------------------------------------------------------ resumption

    def state_dict(self, num_samples: int | None = None, from_beginning: bool = True) -> dict[str, Any]:
        """Where the epoch is, for :meth:`load_state_dict`.

        ``num_samples`` is the global sample count consumed in this epoch (over all data-parallel ranks,
        replicas counted once), from the epoch's beginning or, with ``from_beginning=False``, from the last
        resumption point. Without it, the samples this process handed out so far are used (times the
        data-parallel ranks): exact when iterating in-process or through ``StreamingDataLoader``.
        """
        resumed = self._resume[1] if self._resume and self._resume[0] == self.epoch else 0
        if num_samples is None:
            if self._consumed == 0 and not self._counted_by_loader:
                log.debug("state_dict() without num_samples counts only samples iterated in this process; "
                          "with DataLoader workers use StreamingDataLoader or pass num_samples")
            num_samples = resumed + self._consumed * self.dp_world
        elif not from_beginning:
            num_samples += resumed
        return {"epoch": self.epoch, "sample_in_epoch": int(num_samples),
                "num_canonical_nodes": self.num_canonical_nodes, "shuffle_seed": self.shuffle_seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: the next iteration of that epoch starts after ``sample_in_epoch`` global samples."""
        if state.get("num_canonical_nodes", self.num_canonical_nodes) != self.num_canonical_nodes or \
                state.get("shuffle_seed", self.shuffle_seed) != self.shuffle_seed:
            raise StreamingError(
                f"checkpoint was taken with num_canonical_nodes={state.get('num_canonical_nodes')} and "
                f"shuffle_seed={state.get('shuffle_seed')}; this dataset has {self.num_canonical_nodes} and "
                f"{self.shuffle_seed}: the sample order would differ"
            )
        self.epoch = int(state["epoch"])
        self._consumed = 0
        self._resume = (self.epoch, int(state["sample_in_epoch"]))


class _FetchPlan:
    """Which process of this node fetches which shard, and a thread that fetches this process's share ahead.

    Every process of the node (local ranks x DataLoader workers) computes the same list of shards in the
    order the node first needs them and owns every ``participants``-th one. An owner fetches its shards up to
    ``predownload`` samples ahead of where it is; the others wait for them (see :mod:`smalti.streaming.cache`).
    """

    def __init__(self, ds: StreamingDataset, grid: np.ndarray, worker_id: int, num_workers: int) -> None:
        self.ds = ds
        self.progress = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.owner: dict[int, int] = {}
        if ds.predownload <= 0 or len(grid) == 0:
            return
        b = ds.batch_size
        first_rank = ds.rank // ds.local_world * ds.local_world
        lo = first_rank // ds.replication
        hi = (first_rank + ds.local_world - 1) // ds.replication + 1
        node = grid[:, lo * b : hi * b]
        cols = node.shape[1]
        flat = node.reshape(-1)
        valid = np.flatnonzero(flat >= 0)
        shards, _ = ds._locate(flat[valid])
        unique, first = np.unique(shards, return_index=True)
        by_need = np.argsort(first, kind="stable")
        need_shards, need_steps = unique[by_need], valid[first[by_need]] // cols
        participants = ds.local_world * num_workers
        me = ds.local_rank * num_workers + worker_id
        owners = np.arange(len(need_shards)) % participants
        self.owner = dict(zip(need_shards.tolist(), owners.tolist()))
        self.me = me
        lookahead = max(1, math.ceil(ds.predownload / b)) * num_workers
        todo = [(int(step), int(shard)) for shard, step, owner in zip(need_shards, need_steps, owners)
                if owner == me]
        self.deferring = participants > 1
        self._thread = threading.Thread(target=self._run, args=(todo, lookahead), daemon=True,
                                        name="smalti-streaming-prefetch")
        self._thread.start()

    def defer(self, shard: int) -> bool:
        return bool(self.owner) and self.deferring and self.owner.get(shard, self.me) != self.me

    def _run(self, todo: list[tuple[int, int]], lookahead: int) -> None:
        for step, shard in todo:
            while step > self.progress + lookahead:
                if self._stop.wait(0.005):
                    return
            if self._stop.is_set():
                return
            try:
                self.ds.cache.ensure(shard)
            except Exception as exc:  # the reader meets it again, and raises it, when it needs the shard
                log.debug("prefetch of shard %d failed: %r", shard, exc)

    def finish(self) -> None:
        """The iteration ended normally: let the thread fetch what peers still expect from this process."""
        if self._thread is not None:
            self.progress = 1 << 62
            self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
