"""A Hydra callback that keeps credentials out of the config files Hydra saves with a run.

Hydra writes ``<run>/.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` (and a sweep's
``multirun.yaml``) just before the job starts; ``smalti-train``'s config registers :class:`RedactRunFiles`
under ``hydra.callbacks``, which rewrites each of them at job start with :func:`smalti.core.redact.redact`
applied (URL userinfo, values of keys naming secrets, ``secret_key=value`` overrides), each file replaced
atomically. The running job keeps the real values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from smalti.core.redact import redact

_RUN_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


class RedactRunFiles(Callback):
    """Rewrites the run's saved Hydra files without credentials, at job start."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        hydra = config.hydra
        files = []
        if hydra.output_subdir is not None:
            folder = Path(hydra.runtime.output_dir) / str(hydra.output_subdir)
            files += [folder / name for name in _RUN_FILES]
        if hydra.mode == RunMode.MULTIRUN:
            files.append(Path(hydra.sweep.dir) / "multirun.yaml")
        for path in files:
            if path.is_file():
                rewrite_redacted(path)


def rewrite_redacted(path: Path) -> None:
    """Replace the YAML file ``path`` with its redacted copy (interpolations are kept as written)."""
    saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    clean = redact(saved)
    if clean == saved:
        return
    tmp = path.with_name(f".{path.name}.redacted.tmp")
    OmegaConf.save(OmegaConf.create(clean), tmp)
    os.replace(tmp, path)
