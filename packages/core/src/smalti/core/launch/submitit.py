"""Slurm and local jobs through Hydra's submitit launcher, with torchrun started on every node.

The launcher configs ``conf/hydra/launcher/submitit_{slurm,local}.yaml`` name the launcher classes in
``hydra_plugins.smalti_launch`` (Hydra only builds launchers from ``hydra_plugins.*``); they add to
hydra-submitit-launcher's options:

- ``torchrun``: :class:`~smalti.core.launch.torchrun.TorchrunSettings` (ranks per node, restarts, port, ...);
- ``cordon_file``: smalti-health's cordon list; its hosts are added to Slurm's ``--exclude``;
- ``dry_run``: write the sbatch script(s) under ``<sweep dir>/.submitit/dry-run/`` instead of submitting.

For Slurm, the sbatch script's setup lines compute the rendezvous once per job (first host of
``SLURM_JOB_NODELIST``, ``SLURM_JOB_NUM_NODES``, ``SLURM_JOB_ID``) and export torchrun's arguments as
``SMALTI_TORCHRUN_ARGS``; ``srun`` starts one submitit task per node, whose Hydra task function hands them to
torchrun (:mod:`smalti.core.launch.node`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from smalti.core.errors import ConfigError
from smalti.core.launch.cordon import read_cordon_file
from smalti.core.launch.script_values import check_slurm_params
from smalti.core.launch.torchrun import PORT_BASE, PORT_SPAN, TorchrunSettings

log = logging.getLogger(__name__)

#: Environment variable carrying torchrun's options (everything before ``-m smalti.core.cli.train``) to each node.
TORCHRUN_ARGS_ENV = "SMALTI_TORCHRUN_ARGS"
#: The first host of the allocation, which hosts the c10d rendezvous store.
RDZV_HOST_LINE = 'export SMALTI_RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
#: The keys of hydra-submitit-launcher's ``BaseQueueConf``, which submitit's AutoExecutor takes without a prefix.
GENERIC_KEYS = frozenset(
    {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name", "stderr_to_stdout"}
)
_SAFE_ARG = re.compile(r"^[\w@%+=:,./\-]+$")


def check_one_task_per_node(params: dict[str, Any]) -> None:
    """torchrun starts the ranks, so submitit must start exactly one task (one agent) per node."""
    tasks = params.get("tasks_per_node", 1)
    if tasks != 1:
        raise ConfigError(
            f"hydra.launcher.tasks_per_node={tasks}: smalti starts one torchrun agent per node, which starts the "
            "ranks; keep tasks_per_node=1 and set hydra.launcher.torchrun.nproc_per_node (or gpus_per_node) instead"
        )


def slurm_setup_lines(settings: TorchrunSettings, gpus_per_node: int | None) -> list[str]:
    """The sbatch setup lines that export ``SMALTI_TORCHRUN_ARGS`` for every node of the job."""
    for arg in settings.extra_args:
        if not _SAFE_ARG.match(arg):
            raise ConfigError(
                f"hydra.launcher.torchrun.extra_args: {arg!r} has characters that would need shell quoting; "
                "use --option=value forms without spaces or quotes"
            )
    # Every argument a setting gives goes inside the double quotes below, where bash still runs $(...) and `...`.
    for arg in settings.args(nnodes=1, nproc_per_node=1, endpoint="host:1", rdzv_id="id"):
        if not _SAFE_ARG.match(arg):
            raise ConfigError(f"hydra.launcher.torchrun: {arg!r} has characters that would need shell quoting; "
                              "it is refused, since it is written into the job script")
    port = str(settings.rdzv_port) if settings.rdzv_port else f"$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))"
    args = settings.args(
        nnodes="$SLURM_JOB_NUM_NODES",
        nproc_per_node=settings.procs_per_node(gpus_per_node),
        endpoint=f"$SMALTI_RDZV_HOST:{port}",
        rdzv_id="$SLURM_JOB_ID",
    )
    return [
        "# smalti: torchrun rendezvous on the first node of the allocation (see smalti.core.launch.submitit)",
        RDZV_HOST_LINE,
        f'export {TORCHRUN_ARGS_ENV}="{" ".join(args)}"',
        f'echo "smalti: each node runs torchrun ${TORCHRUN_ARGS_ENV} -m smalti.core.cli.train <overrides>"',
    ]


def add_cordon_exclude(params: dict[str, Any], cordon_file: str | None) -> None:
    """Add the cordoned hosts to Slurm's ``exclude`` list (keeping hosts already excluded)."""
    if not cordon_file:
        return
    hosts = [c.host for c in read_cordon_file(cordon_file)]
    if not hosts:
        return
    existing = [h for h in str(params.get("exclude") or "").split(",") if h]
    params["exclude"] = ",".join(dict.fromkeys(existing + hosts))
    log.info("excluding %d cordoned host(s) from %s: %s", len(hosts), cordon_file, params["exclude"])


def prepare_slurm_params(
    params: dict[str, Any], settings: TorchrunSettings, cordon_file: str | None
) -> dict[str, Any]:
    """hydra-submitit-launcher's Slurm params with smalti's torchrun setup lines and cordon excludes added.

    Every value is then checked (:func:`~smalti.core.launch.script_values.check_slurm_params`): none can add a
    line of its own to the sbatch script.
    """
    params = dict(params)
    check_one_task_per_node(params)
    params["setup"] = slurm_setup_lines(settings, params.get("gpus_per_node")) + list(params.get("setup") or [])
    add_cordon_exclude(params, cordon_file)
    check_slurm_params(params)
    return params


def make_private_job_root(submitit_folder: str) -> Path:
    """Create the folder above submitit's per-job folders (``<sweep dir>/.submitit``) readable by its owner only.

    submitit pickles each job's config there, real secrets included (the job needs them): no other user may read
    them. Returns the folder.
    """
    parts = Path(submitit_folder).parts
    fixed = next((i for i, part in enumerate(parts) if "%" in part), len(parts))  # up to the first %j
    root = Path(*parts[:fixed]) if fixed else Path(".")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)
    return root


def write_dry_run_scripts(params: dict[str, Any], sweep_dir: Path, num_jobs: int) -> Path:
    """Write the sbatch script submitit would submit for ``num_jobs`` sweep points (one array job); return its path.

    Works without Slurm: it renders the script with submitit's own sbatch writer and submits nothing.
    """
    from submitit.slurm.slurm import SlurmExecutor

    class _NoSrunCheck(SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:  # the real one refuses to build an executor where ``srun`` is missing
            return 1

    folder = make_private_job_root(str(sweep_dir / ".submitit" / "%j")) / "dry-run"
    folder.mkdir(parents=True, exist_ok=True)
    executor = _NoSrunCheck(folder=folder, max_num_timeout=int(params.get("max_num_timeout", 0)))
    given = {k: v for k, v in params.items() if v is not None}  # unset options keep submitit's defaults
    generic = {k: v for k, v in given.items() if k in GENERIC_KEYS}
    specific = {k: v for k, v in given.items() if k not in GENERIC_KEYS | {"submitit_folder", "max_num_timeout"}}
    executor.update_parameters(**executor._convert_parameters(generic), **specific)
    if num_jobs > 1:
        executor.parameters["map_count"] = num_jobs
    script = folder / "job.sbatch"
    tmp = script.with_suffix(".tmp")
    tmp.write_text(executor._make_submission_file_text(executor._submitit_command_str, uid="dry-run"))
    tmp.replace(script)
    return script


def describe_jobs(job_overrides: Sequence[Sequence[str]]) -> str:
    """One line per sweep point, for the dry-run report."""
    return "\n".join(f"  #{i}: {' '.join(o)}" for i, o in enumerate(job_overrides))
