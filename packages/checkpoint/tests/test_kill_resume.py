"""The proof: 2-rank gloo FSDP runs through ``smalti-train`` under torchrun, killed (SIGKILL) and resumed.

A resumed run must end with parameters and optimizer state bit-identical to an uninterrupted one, and a
checkpoint whose save was in flight at the kill must be ignored (resume from the previous one).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from smalti.checkpoint.export import load_full
from smalti.testing.torchrun import run_process_group, torchrun_command

SUPPORT = str(Path(__file__).parent / "support")
QUICK = ["model=mlp", "data=synthetic", "parallelism=fsdp", "checkpoint=dcp", "callbacks=[]", "logger=[]",
         "trainer.max_duration=8ba", "trainer.eval_interval=100ba", "data.eval=null"]


def train(tmp: Path, name: str, *overrides: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([SUPPORT, *sys.path]),
           "SMALTI_RUN_NAME": name}
    cmd = torchrun_command(2) + ["-m", "smalti.core.cli.train", *QUICK, f"hydra.run.dir={tmp / name}", *overrides]
    return run_process_group(cmd, env=env, cwd=tmp, timeout=180)


def final_state(folder: Path):
    return {**load_full(folder, "model."), **{f"optim.{k}": v for k, v in load_full(folder, "optim.").items()}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    out = train(tmp, "ref", f"checkpoint.save_folder={tmp / 'ck'}", "checkpoint.save_interval=null")
    assert out.returncode == 0, out.stderr[-4000:]
    return final_state(tmp / "ck" / "ep0-ba8")


def assert_bit_identical(reference, resumed):
    assert set(reference) == set(resumed)
    for key in reference:
        assert torch.equal(reference[key], resumed[key]), key


def test_killed_fsdp_run_resumes_bit_identical(tmp_path, reference):
    ck = tmp_path / "ck"
    common = [f"checkpoint.save_folder={ck}", "checkpoint.save_interval=4ba", "checkpoint.autoresume=true"]
    killed = train(tmp_path, "run", *common, "+callbacks.kill._target_=ckpt_faults.KillAt", "+callbacks.kill.batch=6")
    assert killed.returncode != 0
    assert (ck / "ep0-ba4" / "manifest.json").is_file() and not (ck / "ep0-ba8").exists()
    resumed = train(tmp_path, "run", *common)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming at epoch 0, batch 4" in resumed.stdout + resumed.stderr
    assert_bit_identical(reference, final_state(ck / "ep0-ba8"))


def test_kill_during_async_save_resumes_from_the_previous_checkpoint(tmp_path, reference):
    ck = tmp_path / "ck"
    common = [f"checkpoint.save_folder={ck}", "checkpoint.save_interval=2ba", "checkpoint.autoresume=true",
              "checkpoint.async_save=true"]
    killed = train(tmp_path, "run", *common, "checkpoint._target_=ckpt_faults.SlowCommitCheckpointer",
                   "+checkpoint.slow_from=4", "+checkpoint.delay_s=60",
                   "+callbacks.kill._target_=ckpt_faults.KillAt", "+callbacks.kill.batch=5")
    assert killed.returncode != 0
    assert (ck / "ep0-ba2" / "manifest.json").is_file()
    assert (ck / "ep0-ba4").is_dir() and not (ck / "ep0-ba4" / "manifest.json").exists()  # half-written
    resumed = train(tmp_path, "run", *common)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    log = resumed.stdout + resumed.stderr
    assert "resuming at epoch 0, batch 2" in log and "ep0-ba4" in log  # the partial one is reported
    assert (ck / "ep0-ba4" / "manifest.json").is_file()  # saved again and committed this time
    assert_bit_identical(reference, final_state(ck / "ep0-ba8"))
