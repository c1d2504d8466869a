"""A Hydra callback that saves a run's config files itself, without credentials and readable by its owner only.

Hydra would write ``<run>/.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` in plain text, with the
process's umask (world-readable by default), before any job code runs. ``smalti-train``'s config sets
``hydra.output_subdir: null``, so Hydra writes none of them, and registers :class:`RedactRunFiles` under
``hydra.callbacks``: at job start it writes the same three files under ``<run>/<subdir>`` (``.hydra`` by
default) with :func:`smalti.core.redact.redact` applied (URL userinfo, values of keys naming secrets,
``secret_key=value`` overrides) and mode 0600, each atomically. The running job keeps the real values.

A sweep's ``multirun.yaml`` is saved by Hydra's sweeper itself, in plain text, with no setting to turn it off.
So at sweep start (before the sweeper runs) the callback writes the redacted file beside it under a hidden
name and makes ``multirun.yaml`` a link to ``/dev/null``, which the sweeper's save then writes into; the first
job to start (or the sweep's end, when no job runs, as in a dry run) moves the redacted file into place.

At job end the callback also redacts what Hydra prints of a failed job ("Error executing job with overrides:
[...]" and the exception's traceback).
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from smalti.core.redact import redact, redact_exception, remember_secrets

#: Owner read and write only: a run's config can hold what a user meant to keep private.
FILE_MODE = 0o600
#: The file Hydra's sweeper saves a sweep's config in, and the redacted copy waiting to replace it.
SWEEP_FILE = "multirun.yaml"
PENDING_SWEEP_FILE = f".{SWEEP_FILE}.redacted"


class RedactRunFiles(Callback):
    """Writes the run's Hydra config files redacted and owner-only, at job start (``subdir=None``: none).

    Args:
        subdir: the folder under the run's output folder that holds the files (Hydra's ``.hydra``).
    """

    def __init__(self, subdir: str | None = ".hydra") -> None:
        self.subdir = subdir

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        hydra = config.hydra
        remember_secrets(OmegaConf.to_container(hydra.overrides, resolve=False))
        if self.subdir is not None:
            folder = Path(hydra.runtime.output_dir) / self.subdir
            task = copy.deepcopy(config)
            with read_write(task), open_dict(task):
                del task["hydra"]
            write_redacted(folder / "config.yaml", OmegaConf.to_container(task, resolve=False))
            write_redacted(folder / "hydra.yaml", {"hydra": OmegaConf.to_container(hydra, resolve=False)})
            write_redacted(folder / "overrides.yaml", OmegaConf.to_container(hydra.overrides.task, resolve=False))
        if hydra.mode == RunMode.MULTIRUN:
            settle_sweep_file(Path(hydra.sweep.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        remember_secrets(OmegaConf.to_container(config.hydra.overrides, resolve=False))
        sweep_dir = Path(config.hydra.sweep.dir)
        write_redacted(sweep_dir / PENDING_SWEEP_FILE, OmegaConf.to_container(config, resolve=False))
        link = sweep_dir / f".{SWEEP_FILE}.{os.getpid()}.link"
        link.unlink(missing_ok=True)
        link.symlink_to(os.devnull)
        os.replace(link, sweep_dir / SWEEP_FILE)  # the sweeper's plain-text save goes to /dev/null

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        settle_sweep_file(Path(config.hydra.sweep.dir))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        job_return.overrides = redact(list(job_return.overrides or []))
        result = getattr(job_return, "_return_value", None)
        if isinstance(result, BaseException):
            redact_exception(result)


def settle_sweep_file(sweep_dir: Path) -> None:
    """Move the sweep's redacted ``multirun.yaml`` into place, if no other job did it first."""
    with contextlib.suppress(FileNotFoundError):
        os.replace(sweep_dir / PENDING_SWEEP_FILE, sweep_dir / SWEEP_FILE)


def write_redacted(path: Path, content: Any) -> None:
    """Write ``content`` as YAML to ``path`` with :func:`redact` applied, mode 0600, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(OmegaConf.to_yaml(OmegaConf.create(redact(content))))
    os.chmod(tmp, FILE_MODE)  # O_CREAT's mode is cut by the umask; make it exactly owner-only
    os.replace(tmp, path)

