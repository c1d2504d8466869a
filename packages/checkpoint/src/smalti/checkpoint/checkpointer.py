"""The ``Checkpointer`` callback: when to save, the commit protocol, retention, loading and autoresume."""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from smalti.checkpoint import state_io
from smalti.checkpoint.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from smalti.checkpoint.manifest import (
    VERIFY_LEVELS,
    build_manifest,
    data_files,
    hash_files,
    split_by_size,
    writer_rank,
)
from smalti.checkpoint.naming import MANIFEST_NAME, folder_name, sort_key
from smalti.checkpoint.read_ahead import AheadFile, ReadAhead
from smalti.checkpoint.resume import Found, default_cache_dir, newest_good, resolve_load_path
from smalti.checkpoint.storage import open_store
from smalti.checkpoint.writer import ReusedHostStager, storage_key
from smalti.core import distributed
from smalti.core.errors import ConfigError
from smalti.core.intervals import interval_fires
from smalti.core.plugins import Callback, hookimpl
from smalti.core.time import Time

log = logging.getLogger(__name__)


def retained(names: list[str], keep_last_n: int, keep_every_n: int | None) -> set[str]:
    """The committed checkpoint names that retention keeps: the newest ``keep_last_n`` (all when < 0; all of
    them while fewer are committed), plus every one whose batch count is a multiple of ``keep_every_n``."""
    ordered = sorted(names, key=sort_key)
    keep = set(ordered if keep_last_n < 0 else ordered[-keep_last_n:] if keep_last_n else [])
    if keep_every_n:
        keep |= {n for n in ordered if sort_key(n)[0] % keep_every_n == 0}
    return keep


class Checkpointer(Callback):
    """Sharded, verifiable checkpoints of the whole run state through ``torch.distributed.checkpoint``.

    Args:
        save_folder: local directory or an object-store folder (``s3://``, ``gs://``, ``az://``, ``oci://``
            ``bucket/prefix``, any scheme smalti-storage opens); ``None`` saves nothing (load only).
        save_interval: cadence as a :class:`~smalti.core.time.Time` (``"500ba"``, ``"1ep"``); ``None`` for none.
        save_on_fit_end: also save when training ends (unless that batch was just saved).
        save_on_signal: signal names (``SIGTERM``, ``SIGUSR1``) that make every rank save after the current
            batch and then stop (preemption).
        async_save: stage to host memory and write/upload in the background; the next save waits. Parameters
            and optimizer state are copied to host memory on a helper thread while the next forward and
            backward run; the next optimizer step (and the epoch, evaluation and fit-end events, before any
            other plugin's hook) waits for that copy. Buffers are copied before the save returns. A plugin
            that changes weights in other events must call :meth:`wait_for_staging` first.
        keep_last_n: keep the newest N committed checkpoints (``-1``: all). Deletes happen only after a
            newer checkpoint is committed.
        keep_every_n: additionally keep every checkpoint whose batch count is a multiple of N.
        load_path: checkpoint folder, or a save folder (its newest good checkpoint), local or remote.
        load_weights_only: load the model weights only (no optimizer, time, RNG, data position).
        load_ignore_keys: glob patterns of what not to load: ``model.<fqn>``, ``optim``, ``timestamp``,
            ``schedulers``, ``rng``, ``dataloader``, ``grad_scaler``, ``plugins.<name>``.
        load_strict: fail when model keys differ between the run and the checkpoint.
        autoresume: load the newest committed, verified checkpoint of ``save_folder`` when there is one
            (a corrupt or partial newest one is reported and skipped); else ``load_path``. Object-store
            failures are not skipped: they fail the run. Committed checkpoints of which none verifies fail
            the run too (it never restarts from batch 0 silently).
        overwrite: allow saving into a ``save_folder`` that holds committed checkpoints this run neither
            resumes from nor loads from (or that are newer than the one it loaded). A same-named checkpoint
            is replaced, and once this run commits a checkpoint, every newer one of the earlier run is
            deleted (a later autoresume must not mix the two runs). Without it such a run fails at start.
        verify: ``manifest`` (sizes and sha256 of every file) or ``full`` (also DCP metadata consistency);
            ``none`` only checks that a manifest exists.
        trust_pickles: read checkpoint files whose pickles want classes outside the allow-lists (DCP's
            metadata classes; tensors and plain values) with full unpickling, which can run code from the
            file. Off: such files are refused, naming the file and the class (see
            :mod:`smalti.checkpoint.safe_load`). Only for checkpoints from a trusted source, e.g. ones written
            before smalti-checkpoint stored its rank-local state without pickled NumPy arrays.
        local_cache_dir: where remote checkpoints are staged and downloaded (default: a temp dir per folder).
        thread_count: DCP writer threads per rank (one file each; each file is hashed on its own thread).
        direct_io: write checkpoint files with ``O_DIRECT`` where the file system allows it (no page-cache
            copy: the CPU is left to hashing). ``false`` writes through the page cache with early writeback,
            which can be faster on disks whose direct-I/O path is slow, given cores to spare. Loads read the
            data files ahead with ``O_DIRECT`` too, unless this is ``false``.
        read_ahead_mb: how far (MiB per rank) the background read of the data files may get ahead of the load
            (it starts while the trainer builds the state to load into); the bytes wait in host memory.
        retry_budget_s: seconds each object-store call may keep retrying through a brown-out (smalti-storage's
            one retry policy; ``None``: its default, 120 s, or ``SMALTI_STORAGE_RETRY_BUDGET_S``).
        s3_multipart_mb: object-store uploads above this size go in parts of this size (every scheme).
        s3_retries: obsolete (retries are bounded by ``retry_budget_s`` now); accepted so older configs load.
        timeout_s: collective and save time-out; object-store requests time out after ``min(timeout_s, 120)``.
    """

    def __init__(
        self,
        save_folder: str | None = None,
        save_interval: str | Time | None = "1ep",
        save_on_fit_end: bool = True,
        save_on_signal: list[str] | None = None,
        async_save: bool = False,
        keep_last_n: int = -1,
        keep_every_n: int | None = None,
        load_path: str | None = None,
        load_weights_only: bool = False,
        load_ignore_keys: list[str] | None = None,
        load_strict: bool = True,
        autoresume: bool = False,
        verify: str = "manifest",
        local_cache_dir: str | None = None,
        thread_count: int = 1,
        direct_io: bool = True,
        read_ahead_mb: int = 1024,
        s3_retries: int | None = None,
        s3_multipart_mb: int = 64,
        retry_budget_s: float | None = None,
        timeout_s: float = 600,
        overwrite: bool = False,
        trust_pickles: bool = False,
    ) -> None:
        if verify not in VERIFY_LEVELS:
            raise ConfigError(f"checkpoint.verify={verify!r} must be one of {', '.join(VERIFY_LEVELS)}")
        if autoresume and not save_folder:
            raise ConfigError("checkpoint.autoresume=true needs checkpoint.save_folder (where to look for checkpoints)")
        self.save_folder = str(save_folder) if save_folder else None
        self.save_interval = Time.from_input(save_interval) if save_interval else None
        self.save_on_fit_end = save_on_fit_end
        self.signals = [self._signal_number(name) for name in (save_on_signal or [])]
        self.async_save = async_save
        self.keep_last_n = keep_last_n
        self.keep_every_n = keep_every_n
        self.load_path = load_path
        self.load_weights_only = load_weights_only
        self.load_ignore_keys = list(load_ignore_keys or [])
        self.load_strict = load_strict
        self.autoresume = autoresume
        self.overwrite = overwrite
        self.verify = verify
        self.trust_pickles = bool(trust_pickles)
        self.thread_count = thread_count
        self.direct_io = direct_io
        self.read_ahead_mb = read_ahead_mb
        self.timeout_s = timeout_s
        if s3_retries not in (None, 5):  # 5 was the old default, still in older configs
            log.warning("checkpoint.s3_retries=%s is ignored: object-store retries are bounded by time, "
                        "set checkpoint.retry_budget_s (seconds) instead", s3_retries)
        self.store_options = {"retry_budget_s": retry_budget_s, "multipart_threshold_mb": s3_multipart_mb,
                              "timeout_s": min(timeout_s, 120)}
        self.store = open_store(self.save_folder, **self.store_options) if self.save_folder else None
        if local_cache_dir:
            self.cache_dir = Path(local_cache_dir)
        else:
            self.cache_dir = default_cache_dir(self.store.url if self.store else "load")
        self.loaded: Found | None = None
        self.committed: list[str] = []
        # newer checkpoints of save_folder that the load passed over as partial or damaged: a save may replace them
        self._replaceable: set[str] = set()
        self._group: Any = None
        self._writer_group: Any = None
        self._is_writer = True
        self._rank = 0
        self._world = 1
        self._last_saved_batch = -1
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._metrics: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self._signal_flag = 0
        self._signal_save = False
        self._stop_after_save = False
        self._old_handlers: dict[int, Any] = {}
        self._failed = False
        self._signal_group: Any = None
        self._step_start: float | None = None
        self._step_in_flight = False
        self._normal_steps: deque[float] = deque(maxlen=64)
        self._stager: ReusedHostStager | None = None
        self._step_hooks: dict[int, Any] = {}
        self._read_ahead: ReadAhead | None = None

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _signal_number(name: str | int) -> int:
        if isinstance(name, int):
            return name
        try:
            return int(getattr(signal.Signals, str(name).upper()))
        except AttributeError:
            raise ConfigError(f"checkpoint.save_on_signal has {name!r}, which is not a signal name (SIGTERM, SIGUSR1, ...)") from None

    def _setup_groups(self, state: Any) -> None:
        self._rank, self._world = state.rank, state.world_size
        if not (dist.is_available() and dist.is_initialized()) or self._group is not None:
            return
        self._group = state_io.gloo_group(None, self.timeout_s)
        self._writer_group = self._group
        if self.signals:
            # Its own group: the per-batch signal reduce runs in the training thread while an async save's
            # finalize thread uses self._group, and two threads' collectives on one group could interleave.
            self._signal_group = state_io.gloo_group(None, self.timeout_s)
        mesh = state.device_mesh
        names = list(getattr(mesh, "mesh_dim_names", None) or [])
        if mesh is not None and "dp_replicate" in names and mesh.size(names.index("dp_replicate")) > 1:
            writers = mesh.mesh.select(names.index("dp_replicate"), 0).flatten().tolist()
            # new_group is collective: every rank calls it, only the first replica group is a member.
            self._writer_group = state_io.gloo_group(writers, self.timeout_s)
            self._is_writer = self._rank in writers

    def _broadcast(self, value: Any) -> Any:
        if self._group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if self._group is None:
            return [value]
        out: list[Any] = [None] * self._world
        dist.all_gather_object(out, value, group=self._group)
        return out

    def _staging(self, name: str) -> Path:
        assert self.store is not None
        return self.store.staging(name, self.cache_dir)

    # ------------------------------------------------------------------ set-up and loading

    def on_init(self, state: Any, logger: Any) -> None:
        if self.signals and threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal_flag = signum
        log.warning("received %s: saving a checkpoint after this batch, then stopping", signal.Signals(signum).name)

    def on_before_load(self, state: Any, logger: Any) -> None:
        self._setup_groups(state)
        start = time.perf_counter()
        damaged: dict[str, str] = {}  # checkpoints whose data files failed their sha256 while they loaded
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
                    trust_pickles=self.trust_pickles,
                )
            except Exception as exc:  # a damaged data file may fail to parse: the sha256 verdict decides
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
        relpaths = data_files(found.manifest)
        preferred: dict[str, int] = {}
        if int(found.manifest.get("world_size", 1)) == self._world:
            preferred = {rel: peers.index(writer) for rel in relpaths if (writer := writer_rank(rel)) in peers}
        share = split_by_size(relpaths, found.manifest, len(peers), preferred)[peers.index(self._rank)]
        entries, unchecked = found.manifest["files"], set(found.unchecked)
        files = [AheadFile(rel, entries[rel]["size"], entries[rel]["sha256"] if rel in unchecked else None) for rel in share]
        if files:
            self._read_ahead = ReadAhead(found.folder, files, self.read_ahead_mb << 20, self.direct_io)

    def _data_verdict(self, found: Found, load_error: Exception | None = None) -> CheckpointError | None:
        """Each rank waits for the reading and sha256 of its share of the data files (checked while they
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
        """Rank 0 finds and verifies what to load (the data files' sha256 goes on while they load: see
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

    # ------------------------------------------------------------------ deciding when to save

    def on_batch_start(self, state: Any, logger: Any) -> None:
        self._step_start = time.perf_counter()
        self._step_in_flight = self._thread is not None and self._thread.is_alive()

    def on_batch_end(self, state: Any, logger: Any) -> None:
        # A step is timed from its start to its end, so a save's own blocked time (at the checkpoint event,
        # after batch end) never counts; a step that began while a save was in flight is an in-flight step.
        metrics: dict[str, float] = {}
        if self._step_start is not None:
            step = time.perf_counter() - self._step_start
            if self._step_in_flight:
                metrics["checkpoint/step_time_in_flight_s"] = step
                if self._normal_steps:
                    normal = statistics.median(self._normal_steps)
                    metrics["checkpoint/step_time_s"] = normal
                    metrics["checkpoint/step_time_in_flight_ratio"] = step / normal
            else:
                self._normal_steps.append(step)
            self._step_start = None
        if metrics:
            logger.log_metrics(metrics)
        self._flush_metrics(logger)
        if self.signals:
            self._signal_save = self._any_rank_signalled()

    def _any_rank_signalled(self) -> bool:
        """Whether a save-on-signal arrived on any rank: a MAX over a CPU tensor on a gloo group, so the
        check costs no device synchronisation (an all_reduce on the training device would sync the GPU)."""
        if self._signal_group is None:
            return bool(self._signal_flag)
        return bool(distributed.all_reduce_max(int(self._signal_flag), torch.device("cpu"), self._signal_group))

    def should_checkpoint(self, state: Any, event: Any) -> bool | None:
        event = str(event)
        if event == "batch_end":
            if self._signal_save:
                return True
            if self.save_interval is not None and interval_fires(self.save_interval, state, "batch_end"):
                return True
        elif event == "epoch_end":
            if self.save_interval is not None and interval_fires(self.save_interval, state, "epoch_end"):
                return True
        elif event == "fit_end" and self.save_on_fit_end:
            return True
        return None

    def should_stop(self, state: Any) -> bool | None:
        return True if self._stop_after_save else None

    def on_batch_checkpoint(self, state: Any, logger: Any) -> None:
        if state.checkpoint_requested:
            self.save(state, logger)
            if self._signal_save:
                self._stop_after_save = True

    def on_epoch_checkpoint(self, state: Any, logger: Any) -> None:
        if state.checkpoint_requested:
            self.save(state, logger)

    def on_fit_end(self, state: Any, logger: Any) -> None:
        if state.checkpoint_requested:
            self.save(state, logger)
        self.wait()
        self._flush_metrics(logger)

    def on_exception(self, state: Any, logger: Any, exc: BaseException) -> None:
        self._failed = True

    def on_close(self, state: Any, logger: Any) -> None:
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks.clear()
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()
        if not self._failed:
            self.wait()

    def _flush_metrics(self, logger: Any) -> None:
        """Log what the background threads recorded, one call per record (two saves that finished within one
        batch each keep their ``checkpoint/save_s``)."""
        with self._lock:
            pending, self._metrics = self._metrics, []
        for item in pending:
            logger.log_metrics(item)

    # ------------------------------------------------------------------ saving

    def save(self, state: Any, logger: Any) -> None:
        """Save ``state`` now as ``ep{epoch}-ba{batch}`` (no-op when that batch is already saved or no save folder)."""
        if self.store is None or state.timestamp.batch == self._last_saved_batch:
            return
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - start
        name = folder_name(state.timestamp.epoch, state.timestamp.batch)
        staging = self._staging(name)
        problem = self._clear_stale(name, staging) if self._rank == 0 else None
        problem = self._broadcast(problem)  # also keeps the other ranks from writing before the folder is clear
        if problem is not None:
            raise CheckpointError(problem)
        staging.mkdir(parents=True, exist_ok=True)
        extra_rel, extra_record = state_io.write_rank_local_state(staging, state)
        info = {
            "name": name,
            "timestamp": state.timestamp.state_dict(),
            "world_size": state.world_size,
            "dp_world_size": state.dp_world_size,
            "mesh_shape": list(state.device_mesh.mesh.shape) if state.device_mesh is not None else [],
            "mesh_dim_names": list(state.device_mesh.mesh_dim_names or []) if state.device_mesh is not None else [],
            "run_name": state.run_name,
            "start": start,
        }
        self._last_saved_batch = state.timestamp.batch
        future = None
        records: dict[str, dict[str, Any]] = {}
        if self._is_writer:
            state_dict = state_io.dcp_state_dict(state)
            if self.async_save:
                if self._stager is None:
                    self._stager = ReusedHostStager(background=True)
                self._stager.deferrable = self._guard_step_mutated_state(state)
                future, records = state_io.async_save_dcp(
                    state_dict, staging, self._writer_group, self._stager, self.thread_count, self.direct_io
                )
            else:
                records = state_io.save_dcp(state_dict, staging, self._writer_group, self.thread_count, self.direct_io)
        info["records"] = records
        info["extra"] = (extra_rel, extra_record)
        if self.async_save:
            self._error = None
            self._thread = threading.Thread(
                target=self._finalize_in_background, args=(future, staging, info), name=f"smalti-checkpoint-{name}", daemon=True
            )
            self._thread.start()
            blocked = time.perf_counter() - start
            logger.log_metrics({"checkpoint/blocked_s": blocked, "checkpoint/wait_previous_s": waited})
        else:
            self._finalize(None, staging, info)
            blocked = time.perf_counter() - start
            logger.log_metrics({"checkpoint/blocked_s": blocked})

    def _guard_step_mutated_state(self, state: Any) -> set[int]:
        """The storages of parameters and optimizer state (which only an optimizer step changes), with a
        step pre-hook on every optimizer that waits for their background copy."""
        keys = {storage_key(p) for p in state.model.parameters()}
        for optimizer in state.optimizers:
            if id(optimizer) not in self._step_hooks:
                self._step_hooks[id(optimizer)] = optimizer.register_step_pre_hook(
                    lambda *_: self.wait_for_staging()
                )
            keys |= {storage_key(t) for per_param in optimizer.state.values() for t in per_param.values()
                     if isinstance(t, torch.Tensor)}
        return keys

    def wait_for_staging(self) -> None:
        """Block until an async save's background copy to host memory is done (call before changing weights
        or optimizer state outside an optimizer step); the wait is logged as ``checkpoint/staging_wait_s``."""
        if self._stager is None:
            return
        waited = self._stager.wait_for_staging()
        if waited > 0:
            with self._lock:
                self._metrics.append({"checkpoint/staging_wait_s": waited})

    def _is_committed(self, name: str) -> bool:
        """Whether ``name`` in the save folder has a valid manifest (an unreadable one: not a checkpoint)."""
        assert self.store is not None
        try:
            return self.store.read_manifest(name) is not None
        except CheckpointCorruptError:
            return False

    def _clear_stale(self, name: str, staging: Path) -> str | None:
        """Remove what an interrupted earlier save of the same name left, before writing anew.

        A committed checkpoint (valid manifest) is removed only when the load passed it over as damaged or
        ``overwrite`` is set; otherwise the reason not to save is returned.
        """
        assert self.store is not None
        committed = self._is_committed(name)
        if committed and not self.overwrite and name not in self._replaceable:
            return (
                f"{self.store.url}/{name} is a committed checkpoint of another run; it is not overwritten. "
                "Set checkpoint.overwrite=true to replace it, or choose another checkpoint.save_folder"
            )
        if committed:
            log.warning("replacing committed checkpoint %s/%s (%s)", self.store.url, name,
                        "checkpoint.overwrite=true" if self.overwrite else "it failed verification")
        if staging.exists():
            (staging / MANIFEST_NAME).unlink(missing_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
        if name in self.store.list_names():
            log.warning("removing %s/%s, left by an earlier save of the same batch", self.store.url, name)
            self.store.delete(name)
        return None

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its error here, in the training thread."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout=self.timeout_s)
            if thread.is_alive():
                raise CheckpointError(
                    f"the checkpoint save in flight did not finish within timeout_s={self.timeout_s:.0f} s "
                    "(slow storage or a stuck rank); raise checkpoint.timeout_s or check the other ranks' logs"
                )
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _finalize_in_background(self, future: Any, staging: Path, info: dict[str, Any]) -> None:
        try:
            self._finalize(future, staging, info)
        except BaseException as exc:
            log.error("asynchronous checkpoint %s failed: %s", info["name"], exc)
            self._error = exc

    def _my_files(self, staging: Path) -> list[str]:
        files = [state_io.extra_relpath(self._rank)]
        if self._is_writer:
            writer_rank = dist.get_rank(group=self._writer_group) if self._writer_group is not None else 0
            files += sorted(p.name for p in staging.glob(f"__{writer_rank}_*.distcp"))
            if writer_rank == 0:
                files.append(".metadata")
        return files

    def _finalize(self, future: Any, staging: Path, info: dict[str, Any]) -> None:
        """Hash (and upload) this rank's files, then rank 0 writes the manifest last, moves ``latest`` and prunes."""
        assert self.store is not None
        name = info["name"]
        records: dict[str, Any] = {}
        error = None
        try:
            if future is not None:
                future.result(timeout=self.timeout_s)
            mine = self._my_files(staging)
            written = dict(info["records"])
            extra_rel, extra_record = info["extra"]
            written[extra_rel] = extra_record
            unhashed = [rel for rel in mine if rel not in written]
            if unhashed:  # not seen by the hashing writer (should not happen): read them back
                written.update(hash_files(staging, unhashed))
            records = {rel: written[rel] for rel in mine}
            for rel in mine:
                self.store.publish(staging, name, rel)
        except Exception as exc:
            error = f"rank {self._rank}: {exc}"
        gathered = [(records, error)]
        if self._group is not None:
            gathered = [None] * self._world if self._rank == 0 else None
            dist.gather_object((records, error), gathered, dst=0, group=self._group)
        status = None
        if self._rank == 0:
            status = self._commit(name, staging, info, gathered)
        status = self._broadcast(status)
        self.store.release_staging(staging)
        if status is not None:
            raise CheckpointError(status)
        with self._lock:
            self._metrics.append({"checkpoint/save_s": time.perf_counter() - info["start"]})
            self.committed.append(name)

    def _commit(self, name: str, staging: Path, info: dict[str, Any], gathered: list[Any]) -> str | None:
        assert self.store is not None
        errors = [err for _, err in gathered if err]
        if errors:
            return f"checkpoint {self.store.url}/{name} was not committed (the previous ones are kept): " + "; ".join(errors)
        files: dict[str, Any] = {}
        for records, _ in gathered:
            files.update(records)
        try:
            manifest = build_manifest(
                name, files, info["world_size"], info["mesh_shape"], info["mesh_dim_names"], info["timestamp"],
                writer_ranks=sorted(dist.get_process_group_ranks(self._writer_group)) if self._writer_group is not None else [0],
                extra={"run_name": info["run_name"], "dp_world_size": info["dp_world_size"],
                       "bytes": sum(f["size"] for f in files.values())},
            )
            self.store.write_manifest(name, manifest)  # the commit: after every rank's files
            self.store.write_latest(name)
            log.info("committed checkpoint %s/%s (%d files, %.1f MB)", self.store.url, name, len(files), manifest["bytes"] / 1e6)
            if self.overwrite:
                for newer in [n for n in self.store.list_names() if sort_key(n) > sort_key(name)]:
                    log.warning("checkpoint.overwrite=true: deleting %s/%s, left by an earlier run", self.store.url, newer)
                    self.store.delete(newer)
            self._prune(name)
        except Exception as exc:
            return f"checkpoint {self.store.url}/{name} was not committed: {exc}"
        return None

    def _prune(self, newest: str) -> None:
        """Retention: delete older checkpoints the policy does not keep, now that ``newest`` is committed."""
        assert self.store is not None
        if self.keep_last_n < 0:
            return
        committed, partial = [], []
        for n in self.store.list_names():
            if sort_key(n) >= sort_key(newest) and n != newest:
                continue
            try:
                (committed if self.store.read_manifest(n) is not None else partial).append(n)
            except CheckpointError:
                partial.append(n)
        keep = retained(committed, self.keep_last_n, self.keep_every_n) | {newest}
        for n in [c for c in committed if c not in keep] + [p for p in partial if p != newest]:
            log.info("retention: deleting %s/%s", self.store.url, n)
            self.store.delete(n)


def _staging_guard(event: str) -> Any:
    """A hook wrapper for ``event`` that waits for an async save's background copy before any plugin's hook
    runs (an EMA swap at evaluation, for one, writes into the parameters)."""

    @hookimpl(wrapper=True, specname=f"on_{event}")
    def guard(self: Checkpointer) -> Any:
        self.wait_for_staging()
        return (yield)

    guard.__name__ = guard.__qualname__ = f"staging_guard_{event}"
    return guard


for _event in ("epoch_start", "epoch_end", "eval_before_all", "before_optimizer_step", "fit_end", "close"):
    setattr(Checkpointer, f"staging_guard_{_event}", _staging_guard(_event))
