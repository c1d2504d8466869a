"""``smalti-train -m hydra/launcher=submitit_*``: a local submitit job that starts torchrun, and the Slurm
script that would be submitted (written by a dry run, checked for the torchrun line, nodes and rendezvous)."""

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_CONF = Path(__file__).resolve().parents[3] / "conf"
QUICK = ["model=mlp", "data=synthetic", "trainer.max_duration=4ba", "trainer.eval_interval=100ba", "callbacks=[]",
         "logger=[jsonl]"]


def smalti_train(args, cwd, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SMALTI_CONF_DIR": str(REPO_CONF)}
    return subprocess.run([sys.executable, "-m", "smalti.core.cli.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_submitit_local_job_runs_torchrun_with_two_ranks(tmp_path):
    out = smalti_train(["-m", "hydra/launcher=submitit_local", "hydra.launcher.torchrun.nproc_per_node=2",
                        "parallelism=ddp", "optimizer.lr=0.003", *QUICK], tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    (job_dir,) = (tmp_path / "multirun").glob("*/0")
    # torchrun started two ranks inside the submitit job, each with its own rank-prefixed log ...
    assert sorted(p.name for p in job_dir.glob("rank*.log")) == ["rank0.log", "rank1.log"]
    rank0 = (job_dir / "rank0.log").read_text()
    assert rank0.startswith("[rank0][") and f"finished {job_dir.parent.name}-0" in rank0
    # ... the agent logged the torchrun command it ran, with the job's overrides ...
    agent = (job_dir / "agent-node0.log").read_text()
    assert re.search(r"torchrun --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d .*-m smalti.core.cli.train", agent)
    assert "optimizer.lr=0.003" in agent
    # ... and the loss rank 0 reported is what the Hydra job returned.
    loss = json.loads((job_dir / ".result.json").read_text())["loss"]
    assert f"with loss {loss:.4f}" in rank0
    (result_pickle,) = (job_dir.parent / ".submitit").glob("*/*_0_result.pkl")
    assert (job_dir.parent / ".submitit").stat().st_mode & 0o777 == 0o700  # the job pickles hold real secrets
    status, job_return = pickle.loads(result_pickle.read_bytes())
    assert status == "success" and job_return.return_value == loss
    assert "optimizer.lr=0.003" in (job_dir / ".hydra" / "overrides.yaml").read_text()


def test_slurm_dry_run_writes_the_sbatch_script(tmp_path):
    cordon = tmp_path / "cordon.json"
    cordon.write_text(json.dumps([{"host": "gpu13", "reason": "XID 79"}]))
    out = smalti_train(["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.nodes=4",
                        "hydra.launcher.gpus_per_node=8", "hydra.launcher.partition=train",
                        "hydra.launcher.torchrun.max_restarts=3", f"hydra.launcher.cordon_file={cordon}",
                        "hydra.launcher.dry_run=true", "optimizer.lr=1e-3,3e-3", *QUICK], tmp_path, timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "validated against ConfigStore schema" not in out.stderr
    (script_path,) = (tmp_path / "multirun").glob("*/.submitit/dry-run/job.sbatch")
    assert script_path.parent.parent.stat().st_mode & 0o777 == 0o700  # submitit's job pickles: owner only
    script = script_path.read_text()
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, flags=re.M))
    assert flags["nodes"] == "4" and flags["ntasks-per-node"] == "1" and flags["gpus-per-node"] == "8"
    assert flags["partition"] == "train" and flags["exclude"] == "gpu13"
    assert flags["array"] == "0-1%2"  # the sweep: one job per point
    setup = script.split("# setup")[1].split("# command")[0]
    assert 'SMALTI_RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in setup
    (torchrun,) = re.findall(r'^export SMALTI_TORCHRUN_ARGS="(.*)"$', setup, flags=re.M)
    assert torchrun == " ".join([
        "--nnodes=$SLURM_JOB_NUM_NODES", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=$SMALTI_RDZV_HOST:$((20000 + SLURM_JOB_ID % 20000))", "--rdzv-id=$SLURM_JOB_ID",
        "--max-restarts=3"])
    assert re.search(r"^srun .* -m submitit.core._submit ", script, flags=re.M)


def test_a_hostile_cordon_entry_never_reaches_the_sbatch_script(tmp_path):
    marker = tmp_path / "pwned"
    cordon = tmp_path / "cordon.json"
    cordon.write_text(json.dumps([{"host": f"gpu-9\ntouch {marker} #", "reason": "x"}]))
    out = smalti_train(["-m", "hydra/launcher=submitit_slurm", f"hydra.launcher.cordon_file={cordon}",
                        "hydra.launcher.dry_run=true", *QUICK], tmp_path, timeout=120)
    assert out.returncode != 0 and "entry 0" in out.stderr and "not a host name" in out.stderr
    assert not list(tmp_path.glob("multirun/*/.submitit/dry-run/job.sbatch")) and not marker.exists()


def test_launcher_options_are_checked(tmp_path):
    out = smalti_train(["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.torchrun.max_restart=3",
                        "hydra.launcher.dry_run=true", *QUICK], tmp_path, timeout=120)
    assert out.returncode != 0 and "max_restart" in out.stderr
    out = smalti_train(["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=8",
                        "hydra.launcher.dry_run=true", *QUICK], tmp_path, timeout=120)
    assert out.returncode != 0 and "tasks_per_node" in out.stderr
