"""The local shard cache of a dataset: fetch (download, decompress, check) shards on demand, evict by LRU.

Several processes (DataLoader workers, local ranks) share one cache directory and coordinate without shared
memory or lock files. Every process computes the same plan, so each shard has one *owner* that fetches it;
another process that needs the shard first waits for the owner's result to appear (files only ever appear
complete, by rename). It waits only while the owner shows progress (its temporary files keep changing);
after ``peer_grace_s`` without progress it fetches the shard itself, so a dead or slow peer costs time, never
correctness.

Every copy the cache makes (a decompressed shard, or a downloaded uncompressed one) gets its xxh3_128
recorded with it when it is made (an extended attribute of the file); each process checks a copy against
that record the first time it opens it, and a copy that fails is made again (from the zip if it is still
there, else downloaded again), so a byte flipped on disk is never returned as a sample.

Under ``cache_limit``, every process evicts by one node-wide recency, the copies' modification times (a
process that reads a shard touches its copy now and then), and first the shards the epoch's fetch plan says
this node reads no more (:class:`~smalti.streaming.fetch_plan.CacheNeeds`). A limit below what the order
needs at once (see ``StreamingDataset.cache_needs``) is not an error: a shard evicted before it is read
again is fetched again, counted (:meth:`ShardCache.counts`) and logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from smalti.storage import is_temp_name
from smalti.storage.atomic import TEMP_MARKER
from smalti.streaming.errors import ShardCorruptError, StreamingError
from smalti.streaming.index_trust import no_links, open_no_links, others_may_write
from smalti.streaming.mds import (
    ShardReader,
    check_copy,
    decompress_shard,
    file_digest,
    record_copy,
    remove_copy,
    verify_file,
)
from smalti.streaming.storage import Fetcher

if TYPE_CHECKING:
    from smalti.streaming.stream import Stream

log = logging.getLogger(__name__)

MAX_OPEN_READERS = 64
MAX_LOST_OPENS = 1000  # a shard evicted this many times in a row between its fetch and its opening: give up
TOUCH_S = 1.0  # how often a process that reads a shard refreshes its copy's mtime (the node's shared recency)
COUNT_SLOTS = 64  # per-process counters of one rank (its main process and DataLoader workers), summed on read
STALE_TMP_S = 15 * 60  # a download's temporary file untouched this long belongs to a dead process
STALE_CHECK_S = 0.05  # how often a process looks for open readers of shards another process evicted
_CACHES: weakref.WeakSet[ShardCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked DataLoader worker starts with no open readers, no checked copies and fresh locks."""
    for cache in list(_CACHES):
        cache._new_process()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ShardCache:
    """Local copies of the shards of ``streams``; ``shards`` lists ``(stream index, index entry)``."""

    def __init__(self, streams: list[Stream], shards: list[tuple[int, dict[str, Any]]], cache_limit: int | None,
                 fetcher: Fetcher, validate_hash: bool,
                 peer_grace_s: float = 2.0, allow_unsafe_types: bool = False) -> None:
        self.streams, self.shards = streams, shards
        self.allow_unsafe_types = allow_unsafe_types
        self.cache_limit = cache_limit
        self.fetcher = fetcher
        self.validate_hash = validate_hash
        self.peer_grace_s = peer_grace_s
        self._lock = threading.Lock()
        self._shard_locks: dict[int, threading.Lock] = {}
        self._checked: set[int] = set()
        self._zips_checked: set[int] = set()  # zips checked by this process and not decompressed yet
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._access: dict[int, float] = {}
        self._touched: dict[int, float] = {}
        self._swept = 0.0
        # (fetches, fetches again) per process slot, and the epoch + 1 in which this rank last had each shard:
        # shared memory, so DataLoader workers count into what the training process reads
        self._counts = torch.zeros((COUNT_SLOTS, 2), dtype=torch.int64).share_memory_()
        self._had = torch.zeros(len(shards), dtype=torch.int32).share_memory_()
        self.epoch = 0
        self.step = 0  # the global batch this process reads now (set by the dataset's iteration)
        self.last_use: np.ndarray | None = None  # last step of the epoch each shard is read by this node
        self.window = 1  # global batches the fetch plan reads ahead
        self._warned = False
        _CACHES.add(self)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers get a fresh cache state, not our locks
        state = self.__dict__.copy()
        state.update(_lock=None, _shard_locks={}, _readers=OrderedDict(), _checked=set(),  # each process checks
                     _zips_checked=set())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _CACHES.add(self)

    def _new_process(self) -> None:
        """Forget what belongs to the parent process: its locks, open readers and checks of local copies."""
        self._lock = threading.Lock()
        self._shard_locks = {}
        self._readers = OrderedDict()
        self._checked = set()
        self._zips_checked = set()
        self.fetcher._new_process()

    def remove_stale_downloads(self) -> None:
        """Delete temporary download files that a killed process left behind (untouched for ``STALE_TMP_S``)."""
        dirs = {s.local_dir() / folder for si, s in enumerate(self.streams) for folder in self.shards.raw_folders(si)}
        dirs |= {s.local_dir() for s in self.streams}
        cutoff = time.time() - STALE_TMP_S
        for folder in dirs:
            if not folder.is_dir():
                continue
            for tmp in folder.glob(".*"):
                if not (is_temp_name(tmp.name) or tmp.name.endswith(".tmp")):  # .tmp: left by older versions
                    continue
                try:
                    if tmp.stat().st_mtime < cutoff:
                        tmp.unlink()
                        log.debug("removed stale temporary download %s", tmp)
                except FileNotFoundError:
                    pass

    def raw_path(self, shard: int) -> Path:
        si, entry = self.shards[shard]
        return self.streams[si].local_dir() / entry["raw_data"]["basename"]

    def is_local(self, shard: int) -> bool:
        return self.raw_path(shard).exists()

    def _touch(self, shard: int) -> None:
        """Record a use of ``shard`` here and, now and then, on its copy's mtime, which every process of the
        node evicts by."""
        now = time.time()
        self._access[shard] = now
        if self.cache_limit is not None and now - self._touched.get(shard, 0.0) > TOUCH_S:
            self._touched[shard] = now
            with contextlib.suppress(OSError):  # not made yet, or evicted: its fetch gives it a fresh mtime
                os.utime(self.raw_path(shard))

    def counts(self) -> dict[str, int]:
        """Shard copies this rank's processes made (downloads and decompressions) and, of those, copies of a
        shard they had already had this epoch (fetched again after an eviction: the cache is too small)."""
        fetches, again = self._counts.sum(0).tolist()
        return {"fetches": int(fetches), "refetches": int(again)}

    def _count_fetch(self, shard: int) -> None:
        worker = get_worker_info()
        slot = 0 if worker is None else 1 + worker.id % (COUNT_SLOTS - 1)
        again = int(self._had[shard]) == self.epoch + 1
        with self._lock:
            self._counts[slot, 0] += 1
            if again:
                self._counts[slot, 1] += 1
        self._had[shard] = self.epoch + 1
        if again:
            level = logging.INFO if self._warned else logging.WARNING
            self._warned = True
            log.log(level, "fetching shard %s again: evicted before this node read it for the last time "
                     "(cache_limit=%d bytes is below what this order needs at once; %d fetched again so far "
                     "by this process)", self.raw_path(shard).name, self.cache_limit or 0,
                     int(self._counts[slot, 1]))

    def ensure(self, shard: int, defer_to_peer: bool = False, evict: bool = True) -> Path:
        """The path of shard ``shard``'s raw file, fetching it first if needed.

        With ``defer_to_peer``, another process is expected to fetch it: wait for that while it progresses.
        ``evict=False`` leaves the eviction to the caller (who opens the copy first).
        """
        raw = self.raw_path(shard)
        self._touch(shard)
        if raw.exists() and shard in self._checked:
            return raw
        with self._lock:
            lock = self._shard_locks.setdefault(shard, threading.Lock())
        with lock:
            # a shard evicted since its owner fetched it is fetched here: the owner will not make it again
            if not raw.exists() and (defer_to_peer and not self._evicted(shard).exists() or self.peer_busy(shard)):
                self._wait_for_peer(shard)
            self._fetch(shard)
        if evict:
            self._evict()
        return raw

    def _evicted(self, shard: int) -> Path:
        """The mark an eviction leaves for shard ``shard`` until its next fetch: the processes that wait for
        the shard's owner to fetch it fetch it themselves instead."""
        raw = self.raw_path(shard)
        return raw.parent / f".evicted.{raw.name}"

    def local_zip(self, shard: int, download: bool = False) -> tuple[Path, bool] | None:
        """Shard ``shard``'s zip on local disk while its raw copy is not made yet: ``(path, checked)``, where
        ``checked`` says it was downloaded here and checked against the index on the way in. ``None`` when
        the shard is not compressed, its raw copy exists, or the zip is only remote and ``download`` is false
        (or another process is fetching the shard: its copy is awaited as usual)."""
        si, entry = self.shards[shard]
        zip_info = entry.get("zip_data")
        raw = self.raw_path(shard)
        if not zip_info or raw.exists():
            return None
        stream = self.streams[si]
        packed = no_links(stream.local_dir(), zip_info["basename"])
        if packed.exists():
            return packed, shard in self._zips_checked
        if not download or stream.remote_root() is None:
            return None
        with self._lock:
            lock = self._shard_locks.setdefault(shard, threading.Lock())
        with lock:
            if raw.exists():
                return None
            if not packed.exists():
                if self.peer_busy(shard):
                    return None
                self._download(shard, zip_info, packed)
                self._zips_checked.add(shard)
        return packed, shard in self._zips_checked

    def zip_checked(self, shard: int) -> None:
        """Shard ``shard``'s local zip was just checked against the index in this process: its decompression
        (next, by this process) need not check it again."""
        self._zips_checked.add(shard)

    def _download(self, shard: int, info: dict[str, Any], fetched: Path) -> None:
        """Download the file ``info`` describes (the shard's zip, or its raw file when uncompressed) to
        ``fetched``, checked (and, a raw file, recorded) before it appears under its name."""
        si, entry = self.shards[shard]
        stream = self.streams[si]
        remote = stream.remote_root()
        if remote is None:
            raise StreamingError(f"shard {fetched} of stream {stream.name} is missing and there is no remote")

        def check(tmp: Path) -> None:  # before the file becomes visible under its real name
            if self.validate_hash:
                verify_file(tmp, info, stream.name, shown_as=fetched)
            if not entry.get("zip_data"):  # the downloaded file is the copy samples are read from: record it
                record_copy(tmp, file_digest(tmp), final=fetched)

        self.fetcher.get(remote, info["basename"], fetched, check, max_bytes=info.get("bytes"))

    def _activity(self, shard: int) -> float | None:
        """When a peer last showed progress on ``shard``: the newest mtime of its temporary or zip files."""
        si, entry = self.shards[shard]
        raw = self.raw_path(shard)
        candidates = list(raw.parent.glob(f".{raw.name}*")) if raw.parent.exists() else []
        if entry.get("zip_data"):
            candidates.append(raw.parent / entry["zip_data"]["basename"])
        newest = None
        for path in candidates:
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                continue
            newest = mtime if newest is None else max(newest, mtime)
        return newest

    def claim(self, shard: int) -> Path | None:
        """Mark shard ``shard`` as about to be fetched by this process (by a thread started next), so other
        processes that need it wait for this copy (see :meth:`peer_busy`); :meth:`release` removes the mark."""
        raw = self.raw_path(shard)
        mark = raw.parent / f".{raw.name}{TEMP_MARKER}claim-{os.getpid()}"
        try:
            raw.parent.mkdir(parents=True, exist_ok=True)
            fd = open_no_links(mark, os.O_WRONLY | os.O_CREAT, 0o600)  # never through a planted link
            try:
                os.utime(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.debug("cannot claim %s: %r", raw, exc)
            return None
        return mark

    @staticmethod
    def release(mark: Path | None) -> None:
        if mark is not None:
            mark.unlink(missing_ok=True)

    def peer_busy(self, shard: int) -> bool:
        """Whether another process is making this shard now: a temporary file or claim of it changed within
        ``peer_grace_s`` (a download, a decompression, or the warm-up a dataset starts at construction)."""
        raw = self.raw_path(shard)
        if not raw.parent.exists():
            return False
        cutoff = time.time() - self.peer_grace_s
        own = f"claim-{os.getpid()}"  # this process's own claim: its thread holds the shard's lock
        for path in raw.parent.glob(f".{raw.name}*"):
            if not is_temp_name(path.name) or path.name.endswith(own):
                continue
            try:
                if path.stat().st_mtime > cutoff:
                    return True
            except FileNotFoundError:
                continue
        return False

    def _wait_for_peer(self, shard: int) -> None:
        raw = self.raw_path(shard)
        started = last = time.time()
        checked = 0.0
        while not raw.exists():
            now = time.time()
            if now - checked > 0.2:  # listing the peer's files costs more than the existence check
                checked = now
                last = max(last, self._activity(shard) or 0.0)
                if now - last > self.peer_grace_s:
                    log.debug("no peer progress on %s for %.1f s; fetching it here", raw, self.peer_grace_s)
                    return
            # Poll quickly: the first batch usually waits on a peer's shard, and every ms of lag shows.
            time.sleep(0.001 if now - started < 1.0 else 0.005)

    def _fetch(self, shard: int) -> None:
        si, entry = self.shards[shard]
        stream = self.streams[si]
        root = stream.local_dir()
        raw = no_links(root, entry["raw_data"]["basename"])  # a planted link would be read, written or deleted
        zip_info = entry.get("zip_data")
        info = zip_info or entry["raw_data"]
        fetched = no_links(root, info["basename"])
        if raw.exists() and shard not in self._checked:
            if zip_info or stream.remote is not None:  # a copy this cache made: check it against its record
                # in a folder other users may write to, a planted copy can come with a forged record
                trust = stream.remote is None or not others_may_write(root)
                state = check_copy(raw, entry["raw_data"], stream.name, trust_record=trust)
                if state == "bad" or (state == "unknown" and (stream.remote is not None or fetched.exists())):
                    if zip_info and not fetched.exists() and stream.remote is None:
                        raise ShardCorruptError(
                            f"shard {raw} of stream {stream.name} differs from the hash recorded when it was "
                            f"decompressed, and its compressed copy {fetched.name} is gone: restore the dataset")
                    log.info("making local copy %s of stream %s again (%s)", raw, stream.name,
                             "failed its check" if state == "bad" else "no record to check it against")
                    remove_copy(raw)
            elif self.validate_hash:
                verify_file(raw, entry["raw_data"], stream.name)  # local data was never checked on the way in
        if raw.exists():
            self._checked.add(shard)
            return
        self._count_fetch(shard)
        self._evicted(shard).unlink(missing_ok=True)
        downloaded = shard in self._zips_checked  # checked on the way in, or by a read of a few rows
        if not fetched.exists():
            self._download(shard, info, fetched)
            downloaded = True
        self._zips_checked.discard(shard)
        if zip_info:
            try:
                decompress_shard(root, entry, stream.name, self.validate_hash and not downloaded)
            except FileNotFoundError:  # a peer finished it and removed the zip in between
                if not raw.exists():
                    raise
            if stream.remote is not None:
                fetched.unlink(missing_ok=True)
        self._checked.add(shard)

    def _evict(self) -> None:
        """Delete downloaded shards until the cache is under ``cache_limit``: first those this node reads no
        more this epoch (by ``last_use``, a window behind ``step`` for the node's slower processes), then the
        least recently used on the node (copies' mtimes, or this process's later use)."""
        if self.cache_limit is None:
            return
        last_use, done = self.last_use, self.step - 2 * max(self.window, 1)
        with self._lock:
            present = []
            for shard, (si, entry) in enumerate(self.shards):
                stream = self.streams[si]
                path = stream.local_dir() / entry["raw_data"]["basename"]
                if stream.remote is None:  # a shard that exists only here is never evicted
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                needed = last_use is None or shard >= len(last_use) or last_use[shard] > done
                recency = max(st.st_mtime, self._access.get(shard, 0.0))
                present.append((needed, recency, shard, path, st.st_size))
            used = sum(p[4] for p in present)
            for _, _, shard, path, size in sorted(present):
                if used <= self.cache_limit:
                    break
                remove_copy(path)
                try:
                    os.close(open_no_links(self._evicted(shard), os.O_WRONLY | os.O_CREAT, 0o600))
                except OSError as exc:
                    log.debug("cannot mark %s evicted: %r", path, exc)
                self._readers.pop(shard, None)
                self._checked.discard(shard)
                used -= size

    def reader(self, shard: int, defer_to_peer: bool = False, vouched: bool = False) -> ShardReader:
        """An open reader of shard ``shard`` (fetched if needed); readers are kept open, most recent first.

        ``vouched``: another process of this node has just fetched and checked the local copy (it handed
        over a batch of it), so an existing copy is opened without being hashed again here.
        """
        now = time.monotonic()
        if now - self._swept > STALE_CHECK_S and self._readers:
            self._swept = now
            self._drop_stale_readers()
        reader = self._readers.get(shard)
        if reader is not None:
            self._readers.move_to_end(shard)
            self._touch(shard)
            return reader
        si, entry = self.shards[shard]
        name = self.streams[si].name
        if vouched and shard not in self._checked:
            try:
                reader = ShardReader(self.raw_path(shard), entry, name, self.allow_unsafe_types)
            except FileNotFoundError:  # evicted since: fetched (and checked) below like any other
                pass
            else:
                self._checked.add(shard)
                return self._keep(shard, reader)
        tries = 0
        while True:
            path = self.ensure(shard, defer_to_peer, evict=False)
            try:
                reader = ShardReader(path, entry, name, self.allow_unsafe_types)
                break
            except FileNotFoundError:  # evicted by another process in between: fetch it again (slower, counted)
                self._checked.discard(shard)
                tries += 1
                if tries >= MAX_LOST_OPENS:
                    raise StreamingError(
                        f"shard {self.raw_path(shard)} of stream {name} was evicted by other processes of this "
                        f"node {tries} times in a row before it could be opened: cache_limit={self.cache_limit} "
                        "bytes holds too few shards for the processes reading at once; raise it") from None
                time.sleep(0.001 * min(tries, 50))
        self._had[shard] = self.epoch + 1
        self._evict()  # after opening: the mapping keeps this copy readable whatever an eviction does
        return self._keep(shard, reader)

    def _drop_stale_readers(self) -> None:
        """Forget open readers whose file is gone or was replaced (evicted, or evicted and fetched again, by
        another process of the node): their mappings close, so the disk space of an evicted shard is not
        held past ``cache_limit`` by a process that had it open (samples handed out are copies)."""
        for shard, reader in list(self._readers.items()):
            try:
                st = os.stat(reader.path)
                stale = (st.st_dev, st.st_ino) != reader.identity
            except FileNotFoundError:
                stale = True
            if stale:
                self._readers.pop(shard, None)
                self._checked.discard(shard)

    def _keep(self, shard: int, reader: ShardReader) -> ShardReader:
        self._readers[shard] = reader
        while len(self._readers) > MAX_OPEN_READERS:
            self._readers.popitem(last=False)
        return reader
