"""Scale-out end to end with smalti-checkpoint: two torchrun agents on this machine act as two nodes; one rank
is killed mid-run, torchrun restarts the workers (``--max-restarts``), autoresume loads the last checkpoint and
the run ends with the same parameters as an uninterrupted one (the session's ``restart_reference`` run on one
node, tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from smalti.testing import free_port  # noqa: E402
from smalti.testing.torchrun import torchrun_command  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "packages" / "core" / "tests" / "launch_fixtures"  # ParamDigest and KillOnce callbacks
TIMEOUT = 280


def run_cmd(run, ckpt_dir):
    return ["-m", "smalti.core.cli.train", *run, f"checkpoint.save_folder={ckpt_dir}"]


def run_agents(commands, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in commands]
    try:
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=30)
    return [p.returncode for p in procs], outs


@pytest.mark.slow
def test_killed_rank_resumes_from_checkpoint_across_two_nodes(tmp_path, restart_reference):
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    marker = faulty / "killed.txt"
    agent = torchrun_command(1, port=free_port(), nnodes=2,
                             extra=["--rdzv-id=faulty", "--max-restarts=1", "--monitor-interval=0.5"])
    kill = ["+callbacks.kill._target_=launch_probe.KillOnce", f"+callbacks.kill.marker={marker}",
            "+callbacks.kill.batch=3"]
    cmd = agent + run_cmd(restart_reference.overrides, faulty / "ckpt") + kill
    codes, outs = run_agents([cmd, cmd], faulty)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert marker.exists()

    from smalti.core.loggers import read_jsonl

    steps = [r["step"] for r in read_jsonl(faulty / "outputs" / "faulty" / "metrics.jsonl")
             if "loss/train/total" in r["metrics"]]
    # Batches 1-3 ran, rank 1 died after 3; the restart resumed after the batch-2 checkpoint, not from batch 0.
    assert steps.count(1) == 1 and steps[-3:] == [4, 5, 6] and 3 in steps[3:]
    assert json.loads((faulty / "digest.json").read_text()) == restart_reference.digest
