"""torchrun across "nodes": two elastic agents on this machine (``--nnodes=2``, c10d on loopback, gloo) run the
same FSDP run as one agent with two ranks, bit for bit; a killed rank is recovered through ``--max-restarts``."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from smalti.testing import free_port
from smalti.testing.torchrun import torchrun_command

FIXTURES = Path(__file__).parent / "launch_fixtures"
RUN = ["model=mlp", "data=synthetic", "parallelism=fsdp", "trainer.max_duration=6ba", "trainer.eval_interval=100ba",
       "callbacks=[]", "logger=[jsonl]", "+callbacks.digest._target_=launch_probe.ParamDigest",
       "+callbacks.digest.path=digest.json"]
TIMEOUT = 240
pytestmark = pytest.mark.slow  # each test starts two torchrun agents with a rank each


def env():
    path = os.pathsep.join(filter(None, [str(FIXTURES), os.environ.get("PYTHONPATH")]))
    # As the README says for multi-node restarts: the agents' shared TCPStore keeps keys across restart rounds
    # and restarted workers can hang in init (pytorch/pytorch#135712); a fresh store per round avoids it.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def run_agents(commands, cwd):
    """Start every agent command at once (each in its own session), wait for all; kill them all on time-out."""
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd in commands]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=30)
    return [p.returncode for p in procs], outputs


def two_node_commands(run_id, extra_run=(), torchrun_extra=()):
    port = free_port()
    agent = torchrun_command(1, port=port, nnodes=2, extra=[f"--rdzv-id={run_id}", *torchrun_extra])
    cmd = agent + ["-m", "smalti.core.cli.train", *RUN, *extra_run]
    return [cmd, cmd]


def losses(run_dir):
    from smalti.core.loggers import read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl")
    return [(r["step"], r["metrics"]["loss/train/total"]) for r in rows if "loss/train/total" in r["metrics"]]


@pytest.fixture(scope="module")
def single_node(tmp_path_factory):
    """The reference: one agent, two ranks."""
    cwd = tmp_path_factory.mktemp("one_node")
    cmd = torchrun_command(2, extra=["--rdzv-id=one-node"]) + ["-m", "smalti.core.cli.train", *RUN]
    codes, outs = run_agents([cmd], cwd)
    assert codes == [0], outs[0][-4000:]
    return cwd


def test_two_agents_as_two_nodes_match_one_node(single_node, tmp_path):
    codes, outs = run_agents(two_node_commands("two-nodes"), tmp_path)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    run_dir = tmp_path / "outputs" / "two-nodes"
    # The run is named by the rendezvous id on both nodes: one output folder, one log per rank.
    assert sorted(p.name for p in run_dir.glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert "[rank0]" in (run_dir / "rank0.log").read_text()
    reference = losses(single_node / "outputs" / "one-node")
    assert len(reference) == 6
    assert losses(run_dir) == reference
    params = json.loads((tmp_path / "digest.json").read_text())
    assert params == json.loads((single_node / "digest.json").read_text())


def test_killed_rank_recovers_through_max_restarts(single_node, tmp_path):
    """Rank 1 is SIGKILLed at batch 3; both agents restart their workers and the run finishes.

    Without a checkpoint the restarted run begins again from batch 0 (deterministically), so its final
    parameters equal the uninterrupted run's. Resuming from a checkpoint is tested in tests/test_scale_out.py.
    """
    marker = tmp_path / "killed.txt"
    kill = ["+callbacks.kill._target_=launch_probe.KillOnce", f"+callbacks.kill.marker={marker}",
            "+callbacks.kill.batch=3"]
    codes, outs = run_agents(two_node_commands("recover", kill, ["--max-restarts=1", "--monitor-interval=0.5"]),
                             tmp_path)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert marker.read_text().startswith("killed rank 1")
    assert any("exitcode: -9" in o for o in outs)  # an agent saw its worker SIGKILLed, and still succeeded
    params = json.loads((tmp_path / "digest.json").read_text())
    assert params == json.loads((single_node / "digest.json").read_text())


def test_without_restarts_a_killed_rank_fails_the_job(tmp_path):
    marker = tmp_path / "killed.txt"
    kill = ["+callbacks.kill._target_=launch_probe.KillOnce", f"+callbacks.kill.marker={marker}",
            "+callbacks.kill.batch=2", "trainer.max_duration=3ba"]
    codes, outs = run_agents(two_node_commands("no-restart", kill, ["--monitor-interval=0.5"]), tmp_path)
    assert marker.exists()
    assert all(code != 0 for code in codes), "\n".join(o[-2000:] for o in outs)
    assert not (tmp_path / "digest.json").exists()
