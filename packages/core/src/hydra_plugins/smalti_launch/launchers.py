"""submitit launchers that start torchrun on every node: ``hydra/launcher=submitit_slurm`` / ``submitit_local``.

Thin subclasses of hydra-submitit-launcher's (the logic lives in :mod:`smalti.core.launch.submitit`), registered
in Hydra's ConfigStore under hydra-submitit-launcher's own option names, with three keys added: ``torchrun``,
``cordon_file`` and ``dry_run``. Hydra validates a YAML option against the ConfigStore entry of the same name,
so the repository's ``conf/hydra/launcher/submitit_*.yaml`` are checked against these schemas (Hydra's
deprecation notice about that matching is silenced by :func:`smalti.core.launch.node.quiet_launcher_schema_notice`). Hydra's plugin
scan imports this module after hydra-submitit-launcher's (``smalti_launch`` sorts after it), so these entries
win. Nothing is defined when hydra-submitit-launcher is not installed (``pip install smalti-core[launch]``).
"""

# No ``from __future__ import annotations``: Hydra runs this module before it is in sys.modules, where
# dataclasses cannot resolve string annotations.
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional  # noqa: UP035 - OmegaConf structured configs want typing's forms

log = logging.getLogger(__name__)

try:
    from hydra_plugins.hydra_submitit_launcher import config as _conf
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher as _submitit
except ImportError:  # the ``launch`` extra is not installed
    _submitit = None

if _submitit is not None:
    from hydra.core.config_store import ConfigStore
    from hydra.core.utils import JobReturn

    @dataclass
    class TorchrunConf:
        """``hydra.launcher.torchrun``: see :class:`smalti.core.launch.torchrun.TorchrunSettings`."""

        nproc_per_node: Optional[int] = None  # noqa: UP045
        rdzv_backend: str = "c10d"
        rdzv_port: Optional[int] = None  # noqa: UP045
        max_restarts: int = 0
        min_nodes: Optional[int] = None  # noqa: UP045
        monitor_interval: Optional[float] = None  # noqa: UP045
        preflight: bool = True
        extra_args: List[str] = field(default_factory=list)  # noqa: UP006

    @dataclass
    class SmaltiSlurmQueueConf(_conf.SlurmQueueConf):
        """hydra-submitit-launcher's Slurm options plus smalti's."""

        _target_: str = "hydra_plugins.smalti_launch.launchers.SlurmLauncher"
        torchrun: TorchrunConf = field(default_factory=TorchrunConf)
        cordon_file: Optional[str] = None  # noqa: UP045
        dry_run: bool = False

    @dataclass
    class SmaltiLocalQueueConf(_conf.LocalQueueConf):
        """hydra-submitit-launcher's local options plus smalti's ``torchrun``."""

        _target_: str = "hydra_plugins.smalti_launch.launchers.LocalLauncher"
        torchrun: TorchrunConf = field(default_factory=TorchrunConf)

    def _settings(torchrun: Any) -> Any:
        from omegaconf import OmegaConf

        from smalti.core.launch.torchrun import TorchrunSettings

        if OmegaConf.is_config(torchrun):
            torchrun = OmegaConf.to_container(torchrun, resolve=True)
        return TorchrunSettings.from_config(torchrun)

    class SlurmLauncher(_submitit.SlurmLauncher):
        """Slurm through submitit: one task per node, each starting torchrun's agent for that node."""

        def __init__(self, torchrun: Any = None, cordon_file: str | None = None, dry_run: bool = False,
                     **params: Any) -> None:
            from smalti.core.launch.submitit import prepare_slurm_params

            super().__init__(**params)
            self.torchrun = _settings(torchrun)
            self.dry_run = bool(dry_run)
            self.params = prepare_slurm_params(self.params, self.torchrun, cordon_file)

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            from smalti.core.launch.submitit import (
                describe_jobs,
                make_private_job_root,
                write_dry_run_scripts,
            )

            if not self.dry_run:
                make_private_job_root(str(self.params["submitit_folder"]))
                return super().launch(job_overrides, initial_job_idx)

            assert self.config is not None
            script = write_dry_run_scripts(self.params, Path(str(self.config.hydra.sweep.dir)), len(job_overrides))
            log.info("dry run: sbatch script for %d job(s) written to %s, not submitted\n%s", len(job_overrides),
                     script, describe_jobs(job_overrides))
            return []

    class LocalLauncher(_submitit.LocalLauncher):
        """submitit's local executor (one node), starting torchrun's agent in each job."""

        def __init__(self, torchrun: Any = None, **params: Any) -> None:
            from smalti.core.launch.submitit import check_one_task_per_node

            super().__init__(**params)
            self.torchrun = _settings(torchrun)
            check_one_task_per_node(self.params)

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            from smalti.core.launch.submitit import make_private_job_root

            make_private_job_root(str(self.params["submitit_folder"]))
            return super().launch(job_overrides, initial_job_idx)

    _store = ConfigStore.instance()
    _store.store(group="hydra/launcher", name="submitit_slurm", node=SmaltiSlurmQueueConf, provider="smalti")
    _store.store(group="hydra/launcher", name="submitit_local", node=SmaltiLocalQueueConf, provider="smalti")
