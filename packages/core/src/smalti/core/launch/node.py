"""Inside a submitit job (Slurm or local), start torchrun's elastic agent for this node.

``smalti-train -m hydra/launcher=submitit_slurm ...`` runs the Hydra task function once per node (one submitit
task per node). Not yet under torchrun there, the task function hands over to :func:`run_node_agent`, which
runs ``torchrun <args> -m smalti.core.cli.train <this job's overrides>`` in-process; each rank then runs the
Hydra app again, under torchrun, and trains. torchrun's arguments come from ``SMALTI_TORCHRUN_ARGS`` (the
Slurm script's setup lines export it) or are computed from submitit's job environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from smalti.core.launch.errors import LaunchError
from smalti.core.launch.submitit import TORCHRUN_ARGS_ENV
from smalti.core.launch.torchrun import TorchrunSettings, derived_port, run_torchrun, train_command
from smalti.core.redact import redact_text

log = logging.getLogger(__name__)

#: Set for the workers by the node agent: where rank 0 writes the run's final loss for the agent to return.
RESULT_FILE_ENV = "SMALTI_RESULT_FILE"
#: "1": torchrun's workers start a fresh store each restart round instead of sharing the agent's, whose keys
#: survive the round and can hang restarted workers across nodes (pytorch/pytorch#135712).
RDZV_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def quiet_launcher_schema_notice() -> None:
    """Silence Hydra's notice that ``conf/hydra/launcher/submitit_*.yaml`` are matched with ConfigStore schemas.

    The match is deliberate (``hydra_plugins.smalti_launch`` registers those schemas). Called at import of
    ``smalti.core.cli.train``: Hydra's plugin scan restores the warning filters, so it cannot be done there.
    """
    warnings.filterwarnings(
        "ignore", message=r"\s*'hydra/launcher/submitit_(slurm|local)' is validated against ConfigStore schema"
    )


def under_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a rank started by torchrun's agent."""
    return "TORCHELASTIC_RUN_ID" in environ or "LOCAL_RANK" in environ


def in_submitit_job(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a submitit task (Slurm or local executor)."""
    return bool(environ.get("SUBMITIT_EXECUTOR"))


def should_start_agent(environ: Mapping[str, str] = os.environ) -> bool:
    """A submitit task that is not yet a torchrun rank starts the agent; everything else trains directly."""
    return in_submitit_job(environ) and not under_torchrun(environ)


def node_torchrun_args(launcher: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> list[str]:
    """torchrun's options for this node: ``SMALTI_TORCHRUN_ARGS`` if the job script set it, else from submitit's job environment."""
    exported = environ.get(TORCHRUN_ARGS_ENV)
    if exported:
        return shlex.split(exported)
    import submitit

    job = submitit.JobEnvironment()
    settings = TorchrunSettings.from_config(launcher.get("torchrun"))
    port = settings.rdzv_port or derived_port(str(job.raw_job_id))
    host = "127.0.0.1" if job.cluster == "local" else job.hostnames[0]
    return settings.args(
        nnodes=job.num_nodes,
        nproc_per_node=settings.procs_per_node(launcher.get("gpus_per_node")),
        endpoint=f"{host}:{port}",
        rdzv_id=str(job.job_id),
    )


def worker_overrides(task_overrides: list[str], output_dir: str) -> list[str]:
    """This job's overrides for the ranks, which write into this job's output folder."""
    return [*task_overrides, f"hydra.run.dir='{output_dir}'"]


def run_node_agent(run_name: str) -> float:
    """Run torchrun for this node with the current Hydra job's overrides; return the loss rank 0 reports.

    ``run_name`` (the composed ``cfg.run_name``) is kept for the ranks, instead of torchrun's run id.

    Call only from the Hydra task function, when :func:`should_start_agent` is true.
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from hydra_plugins.smalti_core.searchpath import CONF_DIR_ENV, repo_conf_dir

    hydra_cfg = HydraConfig.get()
    launcher = OmegaConf.to_container(hydra_cfg.launcher, resolve=True) if hydra_cfg.get("launcher") else {}
    assert isinstance(launcher, dict)
    output_dir = Path(hydra_cfg.runtime.output_dir)
    settings = TorchrunSettings.from_config(launcher.get("torchrun"))
    node = int(os.environ.get("SLURM_NODEID", os.environ.get("SUBMITIT_LOCAL_NODEID", "0")))
    _relabel_agent_logging(output_dir, node)
    if settings.preflight:
        from smalti.core.launch.preflight import run_preflight

        code = run_preflight([])
        if code != 0:
            log.error("preflight failed on node %d (exit %d): not joining the rendezvous", node, code)
            raise SystemExit(code)
    args = node_torchrun_args(launcher)
    overrides = worker_overrides(list(hydra_cfg.overrides.task), str(output_dir))
    # One file for the job (the output folder is on shared storage): rank 0 may run on any node. Every agent
    # clears it before the rendezvous, so before any rank starts; torchrun's exit barrier makes every agent
    # return only after all ranks, rank 0 included, have exited.
    result_file = output_dir / ".result.json"
    result_file.unlink(missing_ok=True)
    env = {RESULT_FILE_ENV: str(result_file), "SMALTI_RUN_NAME": run_name,
           RDZV_STORE_ENV: os.environ.get(RDZV_STORE_ENV, "1")}
    conf = repo_conf_dir()
    if conf is not None:
        env[CONF_DIR_ENV] = str(conf)
    argv = args + train_command(overrides)
    log.info("node %d: torchrun %s", node, redact_text(shlex.join(argv)))
    with _environ(env):
        try:
            run_torchrun(argv)
        except Exception as exc:
            raise LaunchError(f"node {node}: torchrun's workers failed ({type(exc).__name__}); see the rank*.log "
                              f"files in {output_dir} and `smalti-launch logs {output_dir}`") from exc
    return read_result(result_file)


def report_result(loss: float) -> float:
    """Called by every rank after training: rank 0 writes the loss where the node agent looks for it."""
    path = os.environ.get(RESULT_FILE_ENV)
    if path and int(os.environ.get("RANK", "0")) == 0:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps({"loss": loss}))
        os.replace(tmp, path)
    return loss


def read_result(path: Path) -> float:
    """The loss rank 0 reported, or NaN when it reported none (the file is not on storage this node sees)."""
    try:
        return float(json.loads(path.read_text())["loss"])
    except (OSError, ValueError, KeyError):
        return math.nan


def _relabel_agent_logging(output_dir: Path, node: int) -> None:
    """The agent is not a rank: move its Hydra log file off ``rank0.log`` to ``agent-node<N>.log``, relabel its lines."""
    formatter = logging.Formatter(f"[node{node}-agent][%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == output_dir.resolve():
            root.removeHandler(handler)
            handler.close()
            old = Path(handler.baseFilename)
            if old.exists() and old.stat().st_size == 0:
                old.unlink()
            replacement = logging.FileHandler(output_dir / f"agent-node{node}.log")
            replacement.setLevel(handler.level)
            root.addHandler(replacement)
    for handler in root.handlers:
        handler.setFormatter(formatter)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
