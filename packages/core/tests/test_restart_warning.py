"""Plain torchrun with restarts on but without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (restarted workers can fail to
reconnect or hang): rank 0 says so at start, once, with the exact fix. smalti's own launchers set the variable."""

import logging
import os
import sys
from pathlib import Path

import pytest

from smalti.core import distributed
from smalti.core.distributed import restart_store_problem, warn_if_restarts_may_hang
from smalti.testing.torchrun import run_process_group

FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun"


def test_the_problem_is_named_only_when_restarts_share_the_agent_store():
    restarts = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    message = restart_store_problem(restarts)
    assert message is not None and FIX in message and "--max-restarts=3" in message
    assert restart_store_problem({**restarts, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) is None
    assert restart_store_problem({**restarts, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert restart_store_problem({**restarts, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert restart_store_problem({}) is None  # not under torchrun


def test_rank_0_of_the_first_attempt_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(distributed, "_restart_warning_given", False)
    env = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "0"}
    with caplog.at_level(logging.WARNING, logger="smalti.core.distributed"):
        assert not warn_if_restarts_may_hang({**env, "RANK": "1"})
        assert not warn_if_restarts_may_hang({**env, "TORCHELASTIC_RESTART_COUNT": "1"})
        assert warn_if_restarts_may_hang(env)
        assert not warn_if_restarts_may_hang(env)
    assert [r.getMessage().count(FIX) for r in caplog.records] == [1]


@pytest.mark.slow
def test_standalone_torchrun_with_restarts_and_no_variable_warns_on_rank_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(OMP_NUM_THREADS="1", SMALTI_RUN_NAME="warn")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "-m", "smalti.core.cli.train", "model=mlp", "data=synthetic", "data.eval=null", "parallelism=ddp",
           "callbacks=[]", "logger=[]", "trainer.max_duration=2ba", "trainer.eval_interval=null"]
    out = run_process_group(cmd, env=env, cwd=tmp_path, timeout=120)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    lines = [line for line in log.splitlines() if FIX in line]
    assert len(lines) == 1 and "[rank0]" in lines[0], lines
    assert FIX in (Path(tmp_path) / "outputs" / "warn" / "rank0.log").read_text()


def test_the_k8s_manifest_gives_torchrun_the_variable():
    from smalti.core.launch.k8s import PyTorchJobOptions, build_pytorchjob

    manifest = build_pytorchjob(PyTorchJobOptions(name="job", nodes=2, max_restarts=3, env={"A": "b"}))
    containers = [c for spec in manifest["spec"]["pytorchReplicaSpecs"].values()
                  for c in spec["template"]["spec"]["containers"]]
    assert containers
    for container in containers:
        assert "--max-restarts=3" in container["command"]
        env = {e["name"]: e.get("value", "") for e in container["env"]}
        # what torchrun's workers see in the pod: the container's variables plus torchrun's own
        assert restart_store_problem({**env, "TORCHELASTIC_MAX_RESTARTS": "3"}) is None
