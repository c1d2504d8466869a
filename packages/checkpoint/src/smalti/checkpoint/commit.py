"""The commit protocol: every rank writes (and uploads) its files, rank 0 writes the manifest last, moves
``latest`` and applies retention; a failure anywhere leaves the previous checkpoints as they were."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from smalti.checkpoint import state_io
from smalti.checkpoint.errors import CheckpointCorruptError, CheckpointError
from smalti.checkpoint.manifest import build_manifest, hash_files
from smalti.checkpoint.naming import MANIFEST_NAME, sort_key
from smalti.checkpoint.retention import prune

log = logging.getLogger(__name__)


class CommitProtocol:
    """Finishes a save of the :class:`~smalti.checkpoint.Checkpointer` (in the background for async saves):
    clears what an interrupted save of the same name left, hashes and publishes each rank's files, commits
    by writing the manifest last, then prunes.

    Part of :class:`~smalti.checkpoint.Checkpointer`, whose ``__init__`` sets the attributes used here.
    """

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
            if info.get("extra_data") is not None:
                state_io.write_rank_local_file(staging, extra_rel, info["extra_data"], check=True)
            written[extra_rel] = extra_record
            unhashed = [rel for rel in mine if rel not in written]
            if unhashed:  # not seen by the hashing writer (should not happen): read them back
                written.update(hash_files(staging, unhashed, self.hash))
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
        prune(self.store, newest, self.keep_last_n, self.keep_every_n)
