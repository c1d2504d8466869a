"""submitit launchers that start torchrun on every node: ``hydra/launcher=submitit_slurm`` / ``submitit_local``.

Thin subclasses of hydra-submitit-launcher's; the logic lives in :mod:`smalti.core.launch.submitit`. Nothing is
defined when hydra-submitit-launcher is not installed (``pip install smalti-core[launch]``), so Hydra's plugin
scan stays quiet.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher as _submitit
except ImportError:  # the ``launch`` extra is not installed
    _submitit = None

if _submitit is not None:
    from hydra.core.utils import JobReturn

    class SlurmLauncher(_submitit.SlurmLauncher):
        """Slurm through submitit: one task per node, each starting torchrun's agent (``torchrun``, ``cordon_file``, ``dry_run`` added)."""

        def __init__(self, torchrun: Any = None, cordon_file: str | None = None, dry_run: bool = False,
                     **params: Any) -> None:
            from omegaconf import OmegaConf

            from smalti.core.launch.submitit import prepare_slurm_params
            from smalti.core.launch.torchrun import TorchrunSettings

            if OmegaConf.is_config(torchrun):
                torchrun = OmegaConf.to_container(torchrun, resolve=True)
            super().__init__(**params)
            self.torchrun = TorchrunSettings.from_config(torchrun)
            self.dry_run = bool(dry_run)
            self.params = prepare_slurm_params(self.params, self.torchrun, cordon_file)

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            if not self.dry_run:
                return super().launch(job_overrides, initial_job_idx)
            from smalti.core.launch.submitit import describe_jobs, write_dry_run_scripts

            assert self.config is not None
            script = write_dry_run_scripts(self.params, Path(str(self.config.hydra.sweep.dir)), len(job_overrides))
            log.info("dry run: sbatch script for %d job(s) written to %s (not submitted)\n%s", len(job_overrides),
                     script, describe_jobs(job_overrides))
            print(f"smalti: dry run, sbatch script written to {script}")
            return []

    class LocalLauncher(_submitit.LocalLauncher):
        """submitit's local executor (one node), starting torchrun's agent in each job (``torchrun`` added)."""

        def __init__(self, torchrun: Any = None, **params: Any) -> None:
            from omegaconf import OmegaConf

            from smalti.core.launch.submitit import check_one_task_per_node
            from smalti.core.launch.torchrun import TorchrunSettings

            if OmegaConf.is_config(torchrun):
                torchrun = OmegaConf.to_container(torchrun, resolve=True)
            super().__init__(**params)
            self.torchrun = TorchrunSettings.from_config(torchrun)
            check_one_task_per_node(self.params)
