"""``Stream`` and ``StreamingDataset``: MDS data from local disk or remote storage, shuffled, split and resumable."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from smalti.streaming.errors import StreamingError
from smalti.streaming.mds import INDEX, ShardReader, decompress_shard, load_index, verify_file
from smalti.streaming.order import pad_to_batches, rank_batches, select_samples, shuffle_order, stream_counts
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


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class StreamingDataset(IterableDataset):
    """Streams samples from MDS shards; also supports ``len()`` (this rank's samples per epoch) and ``ds[i]``.

    Each rank reads ``batch_size`` samples of every global batch; the global batches depend only on the
    seed, ``num_canonical_nodes`` and ``batch_size * data-parallel ranks`` (see :mod:`smalti.streaming.order`).
    Call :meth:`set_epoch` before each epoch (smalti's trainer does). :meth:`state_dict` /
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
        if batching_method not in BATCHING_METHODS:
            raise StreamingError(f"batching_method={batching_method!r} is not one of {', '.join(BATCHING_METHODS)}")
        if partition_algo not in ("orig", "relaxed"):
            raise StreamingError(f"partition_algo={partition_algo!r} must be 'orig' or 'relaxed'")
        self.streams = streams
        env_rank, env_world = _world()
        self.rank = env_rank if rank is None else rank
        self.world_size = env_world if world_size is None else world_size
        self.replication = replication or 1
        if self.world_size % self.replication:
            raise StreamingError(f"replication={self.replication} must divide the world size {self.world_size}")
        self.dp_world = self.world_size // self.replication
        self.dp_rank = self.rank // self.replication
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
        self._resume: tuple[int, int] | None = None
        self._yielded = 0
        self._shards: list[tuple[int, dict[str, Any]]] = []  # (stream index, index entry)
        self._stream_shards: list[list[int]] = []
        for si, stream in enumerate(streams):
            ids = []
            for entry in self._load_stream_index(stream):
                ids.append(len(self._shards))
                self._shards.append((si, entry))
            self._stream_shards.append(ids)
        sizes = np.array([entry["samples"] for _, entry in self._shards], dtype=np.int64)
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_samples = int(self._shard_starts[-1])
        if self.num_samples == 0:
            raise StreamingError(f"streams {[s.name for s in streams]} hold no samples")
        from smalti.streaming.mds import parse_size

        self.cache_limit = parse_size(cache_limit) if cache_limit is not None else None
        if self.cache_limit is not None:
            largest = max((e["raw_data"]["bytes"] + ((e.get("zip_data") or {}).get("bytes") or 0))
                          for _, e in self._shards)
            if self.cache_limit < largest:
                raise StreamingError(f"cache_limit={self.cache_limit} bytes is smaller than the largest shard "
                                     f"({largest} bytes with its zip); raise cache_limit")
        self._lock = threading.Lock()
        self._shard_locks: dict[int, threading.Lock] = {}
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._access: dict[int, int] = {}
        self._clock = 0

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
            for key in ("column_encodings",):
                for enc in entry[key]:
                    if enc == "pkl" and not self.allow_unsafe_types:
                        raise StreamingError(f"stream {stream.name} has a 'pkl' column, which can run code when "
                                             "read; pass allow_unsafe_types=True if you trust it")
        return entries

    def _ensure_local(self, shard: int) -> Path:
        """Download (and decompress, and check) shard ``shard`` if it is not in the local cache; return its path."""
        si, entry = self._shards[shard]
        stream = self.streams[si]
        root = stream.local_dir()
        raw = root / entry["raw_data"]["basename"]
        with self._lock:
            lock = self._shard_locks.setdefault(shard, threading.Lock())
        with lock:
            self._clock += 1
            self._access[shard] = self._clock
            if raw.exists():
                return raw
            zip_info = entry.get("zip_data")
            name = (zip_info or entry["raw_data"])["basename"]
            if not (root / name).exists():
                remote = stream.remote_path(name)
                if remote is None:
                    raise StreamingError(f"shard {root / name} of stream {stream.name} is missing and there is no remote")
                download_file(remote, root / name, self.download_retry, self.download_timeout)
            if zip_info:
                decompress_shard(root, entry, stream.name, self.validate_hash)
                if stream.remote is not None:
                    (root / zip_info["basename"]).unlink(missing_ok=True)
            elif self.validate_hash:
                verify_file(raw, entry["raw_data"], stream.name)
        self._evict()
        return raw

    def _evict(self) -> None:
        """Delete least recently used downloaded shards until the cache is under ``cache_limit``."""
        if self.cache_limit is None:
            return
        with self._lock:
            present = []
            for shard, (si, entry) in enumerate(self._shards):
                stream = self.streams[si]
                path = stream.local_dir() / entry["raw_data"]["basename"]
                if stream.remote is not None and path.exists():  # a local-only shard is never evicted
                    present.append((self._access.get(shard, 0), shard, path))
            used = sum(p.stat().st_size for _, _, p in present)
            for _, shard, path in sorted(present):
                if used <= self.cache_limit:
                    break
                size = path.stat().st_size
                path.unlink(missing_ok=True)
                self._readers.pop(shard, None)
                used -= size

    def _reader(self, shard: int) -> ShardReader:
        reader = self._readers.get(shard)
        if reader is None:
            path = self._ensure_local(shard)
            try:
                reader = ShardReader(path, self._shards[shard][1], self.streams[self._shards[shard][0]].name)
            except FileNotFoundError:  # evicted by another worker in between: fetch again
                reader = ShardReader(self._ensure_local(shard), self._shards[shard][1])
            self._readers[shard] = reader
            while len(self._readers) > 4:
                self._readers.popitem(last=False)
        else:
            self._readers.move_to_end(shard)
        return reader

    def _locate(self, sample: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self._shard_starts, sample, side="right")) - 1
        return shard, sample - int(self._shard_starts[shard])

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index`` of the whole dataset (all streams, in shard order)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range for {self.num_samples} samples")
        shard, offset = self._locate(index)
        return self._reader(shard)[offset]

    # ------------------------------------------------------------------ epochs

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on."""
        self.epoch = epoch

    def _shard_ids(self, shards: list[int]) -> list[np.ndarray]:
        return [np.arange(self._shard_starts[s], self._shard_starts[s + 1]) for s in shards]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch``, padded to whole global batches."""
        global_batch = self.batch_size * self.dp_world
        sizes = [sum(self._shards[s][1]["samples"] for s in ids) for ids in self._stream_shards]
        counts = stream_counts(sizes, self.weights_for_epoch(epoch), self.epoch_size, self.shuffle_seed + epoch)
        per_stream = [select_samples(self._shard_ids(ids), n, self.shuffle_seed + 1000 * si, epoch)
                      for si, (ids, n) in enumerate(zip(self._stream_shards, counts))]

        def order_of(shards: list[np.ndarray]) -> np.ndarray:
            if not self.shuffle:
                return np.concatenate(shards) if shards else np.zeros(0, dtype=np.int64)
            return shuffle_order(shards, self.shuffle_algo, self.shuffle_seed, epoch, self.num_canonical_nodes,
                                 self.shuffle_block_size)

        if self.batching_method == "random" or len(self.streams) == 1:
            return pad_to_batches(order_of([s for shards in per_stream for s in shards]), global_batch)
        orders = [order_of(shards) for shards in per_stream]
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

    def __len__(self) -> int:
        """Samples this rank yields per epoch (including the padding of the last global batch)."""
        return len(self.epoch_order(self.epoch)) // self.dp_world

    def __iter__(self):
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        epoch = self.epoch
        order = self.epoch_order(epoch)
        drop = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        global_batch = self.batch_size * self.dp_world
        order = order[drop - drop % global_batch :] if drop else order
        batches = rank_batches(order, self.batch_size, self.dp_rank, self.dp_world, worker_id, num_workers)
        flat = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
        self._yielded = 0
        prefetch = ThreadPoolExecutor(max_workers=2) if self.predownload else None
        try:
            ahead = 0
            for i, sample in enumerate(flat.tolist()):
                if prefetch is not None and i >= ahead:
                    upcoming = {self._locate(s)[0] for s in flat[i : i + self.predownload].tolist()}
                    for shard in upcoming:
                        prefetch.submit(self._ensure_local, shard)
                    ahead = i + max(1, self.predownload // 2)
                item = self[sample]
                self._yielded += 1
                yield item
        finally:
            if prefetch is not None:
                prefetch.shutdown(wait=True, cancel_futures=True)
        if worker is None:
            self.epoch = epoch + 1

    # ------------------------------------------------------------------ resumption

    def state_dict(self, num_samples: int | None = None, from_beginning: bool = True) -> dict[str, Any]:
        """Where the epoch is: ``num_samples`` global samples consumed (default: what this process yielded × ranks)."""
        if num_samples is None:
            num_samples = self._yielded * self.dp_world
        if not from_beginning and self._resume and self._resume[0] == self.epoch:
            num_samples += self._resume[1]
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
        self._resume = (self.epoch, int(state["sample_in_epoch"]))
