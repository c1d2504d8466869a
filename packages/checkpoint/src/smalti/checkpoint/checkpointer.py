"""The ``Checkpointer`` callback: configuration and the save; the rest in its concern modules."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist

from smalti.checkpoint import state_io
from smalti.checkpoint.commit import CommitProtocol
from smalti.checkpoint.errors import CheckpointError
from smalti.checkpoint.hashes import ALGORITHMS, DEFAULT_ALGORITHM, HashUnavailableError, check_algorithm
from smalti.checkpoint.loading import LoadAndResume
from smalti.checkpoint.manifest import VERIFY_LEVELS
from smalti.checkpoint.naming import folder_name
from smalti.checkpoint.read_ahead import ReadAhead
from smalti.checkpoint.resume import Found, default_cache_dir
from smalti.checkpoint.retention import retained
from smalti.checkpoint.schedule import SaveSchedule
from smalti.checkpoint.storage import open_store
from smalti.checkpoint.writer import ReusedHostStager, storage_key
from smalti.core.config.types import (
    AfterValidator,
    ExistingPath,
    Field,
    IntFromMinusOne,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    TimeStr,
)
from smalti.core.errors import ConfigError
from smalti.core.plugins import Callback, hookimpl
from smalti.core.time import Time

log = logging.getLogger(__name__)

__all__ = ["Checkpointer", "retained"]


def run_in_thread(function: Callable[..., Any], *args: Any) -> Future[Any]:
    """Start ``function(*args)`` on a new thread; its result (or error) comes through the returned future."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the future
            future.set_exception(exc)

    threading.Thread(target=run, name="smalti-ckpt-rank-file", daemon=True).start()
    return future



def _signal_name(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not hasattr(signal.Signals, str(value).upper()):
        raise ValueError("expected signal names such as SIGTERM, SIGUSR1")
    return value


#: A signal by name (``SIGTERM``, ``sigusr1``) or number.
SignalName = Annotated[int | str, AfterValidator(_signal_name)]

class Checkpointer(SaveSchedule, LoadAndResume, CommitProtocol, Callback):
    """Sharded, verifiable checkpoints of the whole run state through ``torch.distributed.checkpoint``.

    Its concerns live in their own modules: when to save (:mod:`~smalti.checkpoint.schedule`), load and
    autoresume (:mod:`~smalti.checkpoint.loading`), the commit protocol (:mod:`~smalti.checkpoint.commit`)
    and retention (:mod:`~smalti.checkpoint.retention`); this class holds the configuration and the save.

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
        verify: ``manifest`` (sizes and digests of every file) or ``full`` (also DCP metadata consistency);
            ``none`` only checks that a manifest exists.
        hash: the digest a save records for every file: ``xxh3_128`` (default: the fastest, guards
            against torn writes, truncation, bit rot and a wrong file), ``blake3`` (cryptographic; the
            ``smalti-checkpoint[blake3]`` extra) or ``sha256``. A load checks each file with the algorithm its
            manifest records, whatever this is set to.
        trust_pickles: read checkpoint files whose pickles want classes outside the allow-lists (DCP's
            metadata classes; tensors and plain values) with full unpickling, which can run code from the
            file. Off: such files are refused, naming the file and the class (see
            :mod:`smalti.checkpoint.safe_load`). Only for checkpoints from a trusted source, e.g. ones written
            before smalti-checkpoint stored its rank-local state without pickled NumPy arrays.
        local_cache_dir: where remote checkpoints are staged and downloaded (default: a folder per save folder in this user's own 0700 cache, see ``default_cache_dir``).
        thread_count: DCP writer threads per rank (one file each).
        direct_io: ``true`` (default): saves write with ``O_DIRECT`` where the file system allows it (every byte
            copied into reused huge-page buffers and hashed there, a helper thread writes each full one; no
            page-cache pressure; see the README). ``false``: saves write through the page cache straight from the
            tensors' memory, with the kernel's writeback started behind every 16 MiB. ``read``: as ``false`` (it
            used to choose the load's way of reading; loads now always read with ``O_DIRECT`` where allowed).
        read_ahead_mb: MiB of huge-page read buffers a load fills ahead of its copy into the tensors (at least
            96: six 16 MiB buffers, three reads in flight); reading starts as soon as the checkpoint is chosen.
        load_once: under HSDP, only the first replica group reads a load from storage and broadcasts it to the
            others over the replicate dimension (``false``: every replica group reads the whole checkpoint).
        retry_budget_s: seconds each object-store call may keep retrying through a brown-out (smalti-storage's
            one retry policy; ``None``: its default, 120 s, or ``SMALTI_STORAGE_RETRY_BUDGET_S``).
        s3_multipart_mb: object-store uploads above this size go in parts of this size (every scheme).
        s3_retries: obsolete (retries are bounded by ``retry_budget_s`` now); accepted so older configs load.
        timeout_s: collective and save time-out; object-store requests time out after ``min(timeout_s, 120)``.
    """

    def __init__(
        self,
        save_folder: str | None = None,
        save_interval: TimeStr | Time | None = "1ep",
        save_on_fit_end: bool = True,
        save_on_signal: list[SignalName] | None = None,
        async_save: bool = False,
        keep_last_n: IntFromMinusOne = -1,
        keep_every_n: PositiveInt | None = None,
        load_path: ExistingPath | None = None,
        load_weights_only: bool = False,
        load_ignore_keys: list[str] | None = None,
        load_strict: bool = True,
        autoresume: bool = False,
        verify: Literal[VERIFY_LEVELS] = "manifest",
        local_cache_dir: str | None = None,
        thread_count: PositiveInt = 1,
        direct_io: bool | Literal["read"] = True,
        read_ahead_mb: PositiveInt = 64,
        load_once: bool = True,
        s3_retries: int | None = None,
        s3_multipart_mb: Annotated[int, Field(ge=5)] = 64,
        retry_budget_s: NonNegativeFloat | None = None,
        timeout_s: PositiveFloat = 600,
        overwrite: bool = False,
        trust_pickles: bool = False,
        hash: Literal[ALGORITHMS] = DEFAULT_ALGORITHM,  # noqa: A002 - the config key is checkpoint.hash
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
        try:
            self.hash = check_algorithm(str(hash))
        except HashUnavailableError as exc:
            raise ConfigError(str(exc)) from None
        if direct_io not in (True, False, "read"):
            raise ConfigError(f"checkpoint.direct_io={direct_io!r} must be true, false or read")
        self.direct_io = direct_io
        self.direct_writes = direct_io is True
        self.read_ahead_mb = read_ahead_mb
        self.load_once = load_once
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
        self._replica_load: state_io.ReplicaLoad | None = None  # HSDP: who reads a load, who receives it
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
            # loads read in the first replica group too, which then broadcasts along each replicate line
            lines = mesh.mesh.movedim(names.index("dp_replicate"), -1).reshape(-1, mesh.mesh.size(names.index("dp_replicate")))
            for line in lines.tolist() if self.load_once else []:
                group = state_io.gloo_group(line, self.timeout_s)
                if self._rank in line:
                    self._replica_load = state_io.ReplicaLoad(self._writer_group, group, line[0], frozenset(writers),
                                                              self._rank in writers)

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
        # captured now; an async save checks that it reads back without unpickling code, and writes the file
        # (temp name, fsync, rename), in the background: a failure there fails that save
        extra_rel, extra_data, extra_record = state_io.dump_rank_local_state(staging, state, self.hash,
                                                                             check=not self.async_save)
        rank_file: Future[None] | None = None
        if not self.async_save:  # written (and fsynced) beside the DCP save rather than before it
            rank_file = run_in_thread(state_io.write_rank_local_file, staging, extra_rel, extra_data)
            extra_data = None
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
        try:
            if self._is_writer:
                state_dict = state_io.dcp_state_dict(state)
                if self.async_save:
                    if self._stager is None:
                        self._stager = ReusedHostStager(background=True)
                    self._stager.deferrable = self._guard_step_mutated_state(state)
                    future, records = state_io.async_save_dcp(
                        state_dict, staging, self._writer_group, self._stager, self.thread_count,
                        self.direct_writes, self.hash,
                    )
                else:
                    records = state_io.save_dcp(state_dict, staging, self._writer_group, self.thread_count,
                                                self.direct_writes, self.hash)
        finally:
            if rank_file is not None:
                rank_file.result()  # its error (disk full, ...) fails the save before anything is committed
        info["records"] = records
        info["extra"] = (extra_rel, extra_record)
        info["extra_data"] = extra_data
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
