"""Launch paths survive a lost worker and end as an uninterrupted run would, bit for bit.

A 2-rank gloo FSDP run of a model with dropout checkpoints every 2 batches with autoresume on (the session's
``restart_reference`` run, tests/conftest.py); rank 1 is SIGKILLed after the batch-2 checkpoint is committed;
torchrun's agent restarts the workers (``--max-restarts=1``), autoresume loads the checkpoint, and the final
weights and optimizer state equal those of the reference run, which nobody killed.

- the README's one-machine line: ``torchrun --standalone ... --max-restarts`` with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it the restarted group hangs: seen here, 150 s time-out);
- the Slurm path (Hydra's submitit launcher, tried with its local executor): its node agent must set the
  variable itself, so the caller's environment here does not have it.
The multi-node line is tested the same way in ``tests/test_scale_out.py`` (two agents as two nodes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from smalti.checkpoint.export import load_full  # noqa: E402
from smalti.testing import free_port  # noqa: E402
from smalti.testing.torchrun import run_process_group  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROBES = ROOT / "packages" / "core" / "tests" / "launch_fixtures"  # launch_probe.KillOnce
VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
WARNING = f"{VARIABLE} is not set"
KILL = ["+callbacks.kill._target_=launch_probe.KillOnce", "+callbacks.kill.batch=3", "+callbacks.kill.rank=1"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]  # a run takes ~15 s alone, minutes on a loaded machine


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(PROBES), os.environ.get("PYTHONPATH")])),
               **extra)
    return env


def torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def standalone(workdir: Path, run: tuple[str, ...], *extra: str):
    """The README's one-machine line (``--standalone`` picks a free port itself) with 2 ranks."""
    workdir.mkdir()
    cmd = [*torchrun(), "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5",
           "-m", "smalti.core.cli.train", *run, f"checkpoint.save_folder={workdir / 'ck'}",
           f"hydra.run.dir={workdir / 'out'}", *extra]
    return run_process_group(cmd, env=environment(**{VARIABLE: "1", "SMALTI_RUN_NAME": workdir.name}), cwd=workdir,
                             timeout=150)


def submitit_local(workdir: Path, run: tuple[str, ...], *extra: str):
    """``smalti-train -m hydra/launcher=submitit_local``: the node agent a Slurm job runs, on this machine."""
    workdir.mkdir()
    cmd = [sys.executable, "-m", "smalti.core.cli.train", "-m", "hydra/launcher=submitit_local",
           "hydra.launcher.torchrun.nproc_per_node=2", "hydra.launcher.torchrun.max_restarts=1",
           "hydra.launcher.torchrun.monitor_interval=0.5", "hydra.launcher.torchrun.preflight=false",
           f"hydra.launcher.torchrun.rdzv_port={free_port()}", *run, f"checkpoint.save_folder={workdir / 'ck'}", *extra]
    # a Slurm job's run name comes from SLURM_JOB_ID; the local launcher has none, so the test names the run
    # (autoresume refuses a generated name)
    return run_process_group(cmd, env=environment(SMALTI_CONF_DIR=str(ROOT / "conf"), SMALTI_RUN_NAME=workdir.name),
                             cwd=workdir, timeout=200)


def final_state(folder: Path) -> dict[str, torch.Tensor]:
    return {**load_full(folder, "model."), **{f"optim.{k}": v for k, v in load_full(folder, "optim.").items()}}


def assert_bit_identical(reference: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert set(reference) == set(got)
    assert [k for k in reference if not torch.equal(reference[k], got[k])] == []


def test_standalone_torchrun_restarts_a_killed_worker_and_ends_as_an_uninterrupted_run(tmp_path,
                                                                                        restart_reference):
    marker = tmp_path / "killed.txt"
    out = standalone(tmp_path / "faulty", restart_reference.overrides, *KILL, f"+callbacks.kill.marker={marker}")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert marker.read_text().startswith("killed rank 1")
    assert "exitcode: -9" in log  # the agent saw its worker SIGKILLed ...
    assert "resuming at epoch 0, batch 2" in log  # ... and the restarted group resumed from the checkpoint
    assert WARNING not in log  # the variable is set: no warning
    assert_bit_identical(final_state(restart_reference.checkpoint),
                         final_state(tmp_path / "faulty" / "ck" / "ep0-ba6"))


def test_submitit_job_restarts_a_killed_worker_and_ends_as_an_uninterrupted_run(tmp_path, restart_reference):
    marker = tmp_path / "killed.txt"
    out = submitit_local(tmp_path / "faulty", restart_reference.overrides, *KILL,
                         f"+callbacks.kill.marker={marker}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert marker.read_text().startswith("killed rank 1")
    (job,) = (tmp_path / "faulty" / "multirun").glob("*/0")
    rank0 = (job / "rank0.log").read_text()
    assert "resuming at epoch 0, batch 2" in rank0
    assert WARNING not in rank0  # the node agent set the variable
    assert_bit_identical(final_state(restart_reference.checkpoint),
                         final_state(tmp_path / "faulty" / "ck" / "ep0-ba6"))
