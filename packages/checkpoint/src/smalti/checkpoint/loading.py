"""Loading and autoresume: choosing the checkpoint (rank 0 verifies, every rank gets the answer), reading it
ahead, loading it, and refusing a save folder that holds another run's checkpoints."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from smalti.checkpoint import state_io
from smalti.checkpoint.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from smalti.checkpoint.hashes import entry_digest, tagged
from smalti.checkpoint.manifest import data_files, split_by_size, writer_rank
from smalti.checkpoint.naming import MANIFEST_NAME, sort_key
from smalti.checkpoint.read_ahead import AheadFile, ReadAhead
from smalti.checkpoint.resume import Found, newest_good, resolve_load_path

log = logging.getLogger(__name__)


class LoadAndResume:
    """Loads the newest committed, verified checkpoint of the save folder (autoresume) or ``load_path`` before
    the run starts, passing over damaged ones, and checks the save folder against another run's checkpoints.

    Part of :class:`~smalti.checkpoint.Checkpointer`, whose ``__init__`` sets the attributes used here.
    """

    def on_before_load(self, state: Any, logger: Any) -> None:
        self._setup_groups(state)
        start = time.perf_counter()
        damaged: dict[str, str] = {}  # checkpoints whose data files failed their digest while they loaded
        while True:
            found, autoresumed = self._choose_checkpoint(damaged)
            if found is None:
                self._check_save_folder(state, None)
                return
            if self._rank != 0 and not (found.folder / MANIFEST_NAME).is_file():
                # another node: fetch our own copy of what rank 0 chose (its data files are checked as they load)
                found = resolve_load_path(found.source, self.cache_dir, self.verify, defer_data=True,
                                          trust_pickles=self.trust_pickles, **self.store_options)
            self._start_read_ahead(found)
            weights_only = self.load_weights_only and not autoresumed  # resuming this run restores everything
            load_error: Exception | None = None
            try:
                state_io.load_checkpoint(
                    state, found.folder, found.manifest, self._group, weights_only=weights_only,
                    ignore_keys=self.load_ignore_keys, strict=self.load_strict, read_ahead=self._read_ahead,
                    trust_pickles=self.trust_pickles, replicas=self._replica_load,
                )
            except Exception as exc:  # a damaged data file may fail to parse: the digest verdict decides
                load_error = exc
            problem = self._data_verdict(found, load_error)
            if isinstance(problem, UnsafeCheckpointError):
                raise problem  # a file that wants to run code is refused, not passed over for an older checkpoint
            if problem is None:
                if load_error is not None:
                    raise load_error
                break
            if not autoresumed and not self._names_save_folder(found):
                raise problem from load_error
            # what was loaded came from a damaged checkpoint: every part of it is loaded again from an older one
            log.error("checkpoint %s failed verification while loading (%s); loading the newest older one", found.source, problem)
            damaged[found.name] = str(problem)
        self.loaded = found
        if not weights_only:
            self._last_saved_batch = state.timestamp.batch
        seconds = time.perf_counter() - start
        logger.log_metrics({"checkpoint/load_s": seconds})
        if self._rank == 0:
            log.info("loaded checkpoint %s in %.2f s; resuming at epoch %d, batch %d", found.source, seconds,
                     state.timestamp.epoch, state.timestamp.batch)
        self._check_save_folder(state, found)

    def _names_save_folder(self, found: Found) -> bool:
        """Whether ``load_path`` names a folder of checkpoints (so an older one may stand in), not one checkpoint."""
        return bool(self.load_path) and found.source.rstrip("/") != str(self.load_path).rstrip("/")

    def _start_read_ahead(self, found: Found) -> None:
        """Start reading (and hashing, where still unchecked) this rank's share of the data files, in the
        background, while the load builds the state it will read them into.

        The ranks that read the same copy (same host, same folder) split the files between them: each rank
        takes the files it wrote when the world size is unchanged (the ones it will load), the rest go by
        size, so a checkpoint of many files is read and verified by many cores at once rather than by rank 0
        alone. Copies on other hosts are checked by their own ranks, even on a shared file system: a path
        says nothing about whether two hosts see the same bytes.
        """
        # ranks with the same copy got the same Found (rank 0's, or a fetch of the same manifest), so the same
        # data files: the copy's identity is enough to agree on the split
        copy = (socket.gethostname(), str(found.folder.resolve()))
        peers = [rank for rank, other in enumerate(self._gather(copy)) if other == copy]
        if self._replica_load is not None:  # HSDP: only the first replica group reads; the others receive
            peers = [rank for rank in peers if rank in self._replica_load.readers]
            if self._rank not in peers:
                return
        relpaths = data_files(found.manifest)
        preferred: dict[str, int] = {}
        if int(found.manifest.get("world_size", 1)) == self._world:
            preferred = {rel: peers.index(writer) for rel in relpaths if (writer := writer_rank(rel)) in peers}
        share = split_by_size(relpaths, found.manifest, len(peers), preferred)[peers.index(self._rank)]
        entries, unchecked = found.manifest["files"], set(found.unchecked)
        files = [AheadFile(rel, entries[rel]["size"], tagged(*entry_digest(entries[rel])) if rel in unchecked else None)
                 for rel in share]
        if files:
            self._read_ahead = ReadAhead(found.folder, files, self.read_ahead_mb << 20)

    def _data_verdict(self, found: Found, load_error: Exception | None = None) -> CheckpointError | None:
        """Each rank waits for the reading and digest of its share of the data files (checked while they
        loaded); every rank gets the verdict (``None``: good; an :class:`UnsafeCheckpointError` when the load
        refused a file on any rank; else the lowest rank's finding)."""
        finding: tuple[Any, ...] | None = None
        if self._read_ahead is not None:
            read_ahead, self._read_ahead = self._read_ahead, None
            try:
                read_ahead.finish(timeout=self.timeout_s)
            except CheckpointCorruptError as exc:
                finding = ("corrupt", str(exc), exc.path)
            except Exception as exc:  # e.g. a time-out or an unreadable file: not a verdict on the checkpoint
                finding = ("error", f"reading the data files of {found.source}: {exc!r}", None)
        if isinstance(load_error, UnsafeCheckpointError):
            finding = ("unsafe", str(load_error), load_error.path, load_error.wanted)
        answers = self._gather(finding)
        for answer in answers:
            if answer is not None and answer[0] == "unsafe":
                return load_error if isinstance(load_error, UnsafeCheckpointError) else UnsafeCheckpointError(*answer[1:])
        for answer in answers:
            if answer is None:
                continue
            kind, message, path = answer[:3]
            if kind == "error":
                raise CheckpointError(message)
            return CheckpointCorruptError(message, path)
        return None

    def _in_save_folder(self, found: Found) -> bool:
        assert self.store is not None
        parent = found.source.rstrip("/").rpartition("/")[0]
        return self.store.same_folder(parent)

    def _check_save_folder(self, state: Any, found: Found | None) -> None:
        """Fail at start when saving would overwrite, or interleave with, another run's committed checkpoints."""
        if self.store is None:
            return
        verdict: Any = None
        if self._rank == 0:
            try:
                verdict = self._save_folder_conflict(state, found)
            except Exception as exc:
                verdict = exc
        verdict = self._broadcast(verdict)
        if isinstance(verdict, BaseException):
            raise verdict
        if isinstance(verdict, set):
            self._replaceable = verdict

    def _save_folder_conflict(self, state: Any, found: Found | None) -> CheckpointError | set[str]:
        """Rank 0: the error to raise, or the names a save may replace (passed over as partial or damaged)."""
        assert self.store is not None
        from_here = found is not None and self._in_save_folder(found)
        replaceable = set(found.skipped_names) if found is not None and from_here else set()
        if self.overwrite:
            return replaceable
        committed = [name for name in self.store.list_names()
                     if name not in replaceable and name not in self.committed and self._is_committed(name)]
        if from_here:
            conflicts = [n for n in committed if sort_key(n)[0] > state.timestamp.batch]
            why = f"this run loaded {found.name} (now at batch {state.timestamp.batch}) and would save over newer ones"
        else:
            conflicts = committed
            why = "this run neither autoresumes from that folder nor loads a checkpoint from it"
        if not conflicts:
            return replaceable
        shown = ", ".join(conflicts[-5:]) + (f" (and {len(conflicts) - 5} more)" if len(conflicts) > 5 else "")
        return CheckpointError(
            f"checkpoint.save_folder={self.store.url} already holds committed checkpoints of another run ({shown}); "
            f"{why}. Saving there would overwrite them and move 'latest' backwards, and a later autoresume (which "
            "picks the newest by name) would mix the two runs. Set checkpoint.autoresume=true to continue from "
            "them, checkpoint.overwrite=true to replace them, or choose another checkpoint.save_folder"
        )

    def _choose_checkpoint(self, damaged: dict[str, str]) -> tuple[Found | None, bool]:
        """Rank 0 finds and verifies what to load (the data files' digest goes on while they load: see
        :meth:`_data_verdict`); every rank gets its answer (or its error)."""
        choice: Any = None
        if self._rank == 0:
            try:
                found, autoresumed = None, False
                if self.autoresume and self.store is not None:
                    found = newest_good(self.store, self.cache_dir, self.verify, defer_data=True, exclude=damaged,
                                        trust_pickles=self.trust_pickles)
                    autoresumed = found is not None
                    if found is None:
                        log.info("autoresume: no committed checkpoint in %s yet", self.store.url)
                if found is None and self.load_path:
                    found = resolve_load_path(self.load_path, None, self.verify, defer_data=True, exclude=damaged,
                                              trust_pickles=self.trust_pickles, **self.store_options)
                if found is not None:
                    found.skipped_names = [*found.skipped_names, *(n for n in damaged if n not in found.skipped_names)]
                choice = (found, autoresumed)
            except Exception as exc:  # sent to every rank so they fail together
                choice = exc
        choice = self._broadcast(choice)
        if isinstance(choice, BaseException):
            raise choice
        return choice if choice is not None else (None, False)
